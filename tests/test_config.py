"""Bad input stops the run before round 1 with one line naming the key, value and what is allowed."""

from pathlib import Path

import pytest

from flowerbed.config import SSL_METHODS, Config, ConfigError, defaults, load_preset, parse_partition
from flowerbed.datasets.federated import client_partitions

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_come_from_pyproject():
    cfg = Config.from_run_config()
    assert cfg.method == defaults()["method"] == "fedavg"
    assert str(cfg.partition) == defaults()["partition"]
    assert Config.from_run_config(cfg.to_run_config()) == cfg


@pytest.mark.parametrize("key,value,needle", [
    ("method", "fedfoo", "known methods"),
    ("dataset", "imagenet", "known data sets"),
    ("model", "vgg", "known models"),
    ("partition", "zipf:2", "unknown partition kind"),
    ("partition", "dirichlet:0", "alpha must be"),
    ("partition", "dirichlet:-1", "alpha must be"),
    ("partition", "dirichlet:1e308", "use iid"),
    ("partition", "dirichlet:abc", "not a number"),
    ("partition", "pathological:0", "integer >= 1"),
    ("partition", "iid:3", "takes no parameter"),
    ("fraction-train", 0.0, "(0, 1]"),
    ("fraction-train", 1.5, "(0, 1]"),
    ("fraction-evaluate", -0.1, "[0, 1]"),
    ("round-timeout", 1e29, "a week"),  # (a hanging fault client: time.sleep overflowed)
    ("ssl-dim", 2 ** 30, "<= 8192"),
    ("local-test-fraction", 1.0, "[0, 1)"),
    ("lr", 0.0, "> 0"),
    ("lr", float("nan"), "> 0"),
    ("num-server-rounds", 0, ">= 1"),
    ("seed", -1, ">= 0"),
    ("batch-size", "32", "number (int)"),
    ("local-epochs", True, "boolean"),
    ("momentum", 1.0, "[0, 1)"),
    ("fedfew-server-lr", 0.0, "> 0"),
    ("fedfew-step", "adam", "paper or normalised"),
    ("fedade-ber-chain", "each", "shared | client"),
    ("fedade-ber-p", 1.5, "[0, 1]"),
    ("fedade-ber-p", float("nan"), "[0, 1]"),
    # NaN and inf used to pass: epsilon=nan fell back to sigma silently, inf gave sigma 10
    ("fedxds-epsilon", float("nan"), "must be in [0, 100000]"),
    ("fedxds-epsilon", float("inf"), "must be in [0, 100000]"),
    # found by a bad-input sweep: each failed late, named another key, or hung the run
    ("fedxds-epsilon", -1.0, "must be in [0, 100000]"),  # blamed fedxds-sigma
    ("fedxds-epsilon", 1e15, "must be in [0, 100000]"),  # opacus' search never ended
    ("seed", 2 ** 63, "below 2**31"),  # Flower's "Value out of range", no key named
    ("lr", 1e308, "out of range"),  # every client: "cannot be converted to type float"
    ("data-root", '/tmp/a"b', "may not contain"),  # refused only once the SuperLink ran
    ("run-name", "../elsewhere", "without '/'"),  # wrote outside output-dir
    ("run-name", "..", "without '/'"),
    ("fedade-fixed-lr", float("nan"), "finite number >= 0"),
    ("fedade-lr-max", float("inf"), "finite number >= 0"),
    # from a bad-input audit: named the default fedade-lr-min; said 'not a number'; ran out of memory
    ("fedade-lr-max", 1e-6, "must be >= fedade-lr-min = 1e-05"),
    ("fedade-lr-max", float("nan"), "finite number >= 0"),
    ("partition", "pathological:2.0", "'2.0' is not a whole number"),
    ("num-models", 1000, "must be <= 100"),
    ("server-device", "gpu", "auto | cpu | cuda | cuda:N"),
])
def test_bad_values_name_the_key(key, value, needle):
    with pytest.raises(ConfigError) as e:
        Config.from_run_config({key: value})
    msg = str(e.value)
    assert f"'{key}'" in msg and needle in msg and "\n" not in msg


def test_settings_that_leave_data_unused_are_warned_about(caplog):
    """From a bad-input audit: public-fraction=0.9 for FedAvg trained its clients on a tenth of
    the data without a word, and train-samples beyond the data set silently meant all of it;
    from a walk-through: a key that only other methods read was taken without a word."""
    from flowerbed.apps.server_app import warn_unused_data
    from flowerbed.datasets.federated import test_set

    def warned(**kw) -> str:
        caplog.clear()
        cfg = Config.from_run_config({"train-samples": 1000, "test-samples": 100, **kw})
        test = test_set(cfg)
        caplog.clear()
        warn_unused_data(cfg, test)
        return "".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")

    assert warned() == "" and warned(method="fedcc", **{"public-fraction": 0.1}) == ""
    assert "public-fraction=0.9 sets that share" in warned(**{"public-fraction": 0.9})
    assert "which fedavg does not use" in caplog.text
    assert "train-samples=99999 is more than the 60000 samples" in warned(**{"train-samples": 99999})
    assert "test-samples=20000 is more than the 10000" in warned(**{"test-samples": 20000})
    assert "never evaluate" in warned(method="fedx")  # local-test-fraction 0.1 by default
    # a key set for a method that does not read it (a walk-through: accepted without a word)
    assert "fedavg does not read fedxds-lambda=1.0 (keys only" in warned(**{"fedxds-lambda": 1.0})
    assert warned(method="fedprox", **{"proximal-mu": 0.1}) == ""
    # from a review: the distillation methods train with Adam at distill-lr, so lr was ignored
    assert "fedcc does not read lr=0.1" in warned(method="fedcc", lr=0.1, **{"public-fraction": 0.1})
    assert "fedade does not read batch-size=64" in warned(method="fedade", **{"batch-size": 64,
                                                                             "num-server-rounds": 4})
    assert warned(method="fedcc", **{"public-fraction": 0.1, "local-epochs": 2}) == ""


@pytest.mark.parametrize("method", SSL_METHODS)
def test_contrastive_methods_need_two_images_a_batch(method):
    """A batch of one is skipped: the run 'finished' with the initial model's accuracy."""
    with pytest.raises(ConfigError, match="'batch-size' = 1 .* at least 2 images"):
        Config.from_run_config({"method": method, "batch-size": 1})
    Config.from_run_config({"method": "fedavg", "batch-size": 1})


def test_a_privacy_budget_opacus_cannot_meet_names_the_key():
    """opacus' 'The privacy budget is too low.' came from inside the ServerApp."""
    cfg = Config.from_run_config({"method": "fedxds", "fedxds-epsilon": 0.05})
    with pytest.raises(ConfigError, match="'fedxds-epsilon' = 0.05 .* fedxds-delta = 1e-05 .* "
                                          "raise fedxds-epsilon"):
        cfg.resolved_sigma()


@pytest.mark.parametrize("method", ["fedavg-ft", "fedfew", "local"])
def test_personalised_methods_need_a_local_test_split(method):
    with pytest.raises(ConfigError, match="'local-test-fraction' = 0.0 is invalid: .* local test splits"):
        Config.from_run_config({"method": method, "local-test-fraction": 0.0})
    with pytest.raises(ConfigError, match="'fraction-evaluate' = 0.0 is invalid: .* clients' evaluation"):
        Config.from_run_config({"method": method, "fraction-evaluate": 0.0})
    Config.from_run_config({"method": "fedfew", "fraction-evaluate": 0.0, "fedfew-eval": "local"})


def test_settings_that_would_leave_nothing_to_measure_are_refused():
    """From an audit: each ran to the end, or failed only after rounds had run."""
    # the distillation methods are scored by their clients' predictions: no accuracy at all
    with pytest.raises(ConfigError, match="'fraction-evaluate' = 0.0 .* feddf is scored by its clients"):
        Config.from_run_config({"method": "feddf", "public-fraction": 0.1, "fraction-evaluate": 0.0})
    # shared samples travel as float16: sigma 2e4 overflowed, and every client was refused
    with pytest.raises(ConfigError, match="'fedxds-sigma' = 20000.0 .* <= 1000"):
        Config.from_run_config({"method": "fedxds", "fedxds-sigma": 2e4})
    # Fed-ADE's sin schedule over 9 steps or fewer has period 2: w = 0.5 at every step
    with pytest.raises(ConfigError, match="'fedade-schedule' = 'sin' .* at least 10 time steps.* gives 9"):
        Config.from_run_config({"method": "fedade", "fedade-schedule": "sin", "num-server-rounds": 18})
    Config.from_run_config({"method": "fedade", "fedade-schedule": "sin", "num-server-rounds": 20})


def test_unknown_key():
    with pytest.raises(ConfigError, match="'no-such-key'.*unknown key"):
        Config.from_run_config({"no-such-key": 1})


def test_k_larger_than_classes_is_refused():
    cfg = Config.from_run_config({"partition": "pathological:11", "train-samples": 2000})
    with pytest.raises(ConfigError, match="'partition'.*11 classes per client.*10 classes"):
        client_partitions(cfg, 10)


def test_more_clients_than_samples_is_refused():
    cfg = Config.from_run_config({"partition": "iid", "train-samples": 50})
    with pytest.raises(ConfigError, match="more clients than training samples"):
        client_partitions(cfg, 51)


def test_impossible_dirichlet_min_size_is_refused(recwarn):
    cfg = Config.from_run_config({"partition": "dirichlet:0.01", "train-samples": 300,
                                  "min-partition-size": 29})
    with pytest.raises(ConfigError, match="'partition'.*cannot split.*lower min-partition-size "
                                          r"\(now 29\)"):
        client_partitions(cfg, 10)
    # without flwr-datasets' warning per redraw, each listing every client's alpha
    assert not [w for w in recwarn if "min_partition_size" in str(w.message)]
    # at a minimum of 1 there is nothing to lower (0 leaves clients empty): the other ways out
    cfg = Config.from_run_config({"partition": "dirichlet:0.05", "train-samples": 200, "seed": 1,
                                  "min-partition-size": 1})
    with pytest.raises(ConfigError, match="cannot split 200 samples over 20 clients") as e:
        client_partitions(cfg, 20)
    assert "lower min-partition-size" not in str(e.value)
    assert "more train-samples or fewer clients, or another seed" in str(e.value)


def test_parse_partition_round_trip():
    for text in ("iid", "dirichlet:0.1", "pathological:2", "shards:3"):
        assert str(parse_partition(text)) == text


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "presets").glob("*.toml")))
def test_presets_are_valid_run_configs(preset):
    from flwr.common.config import parse_config_args

    Config.from_run_config(parse_config_args([str(ROOT / "presets" / preset)]))


@pytest.mark.parametrize("cpus,gpus,flag", [(0, 0, "--cpus-per-client"),
                                            (float("nan"), 0, "--cpus-per-client"),
                                            (1000, 0, "--cpus-per-client"),  # Ray: no actor
                                            (0.5, 0, "--cpus-per-client"),  # flwr run: an int
                                            (1, -0.5, "--gpus-per-client"),
                                            (1, 1.5, "--gpus-per-client")])  # Ray: no such share
def test_client_resources_are_checked_before_ray_starts(cpus, gpus, flag):
    """--cpus-per-client 0 used to reach Ray, which died on a division by zero."""
    from flowerbed.engine import federation_config

    with pytest.raises(ConfigError, match=f"'{flag}'"):
        federation_config(2, cpus, gpus)


def test_typos_get_a_did_you_mean():
    """Found by a README walk-through: an unknown key listed all ~100 keys on one line, and a
    method's typo got the list of methods only."""
    with pytest.raises(ConfigError, match="unknown key; did you mean lr\\?"):
        Config.from_run_config({"lrr": 0.1})
    with pytest.raises(ConfigError, match="did you mean fedavg\\? known methods"):
        Config.from_run_config({"method": "fedavgg"})
    with pytest.raises(ConfigError, match="did you mean fedavg\\?"):
        Config.from_run_config({"method": "FedAvg"})


@pytest.mark.parametrize("key, hint", [("num-clients", "--num-clients"), ("num-supernodes", "--num-clients"),
                                       ("rounds", "num-server-rounds"), ("epochs", "local-epochs")])
def test_keys_that_are_options_name_the_option(key, hint, tmp_path):
    """A README walk-through: num-clients=3 suggested min-clients, num-supernodes num-models,
    and a preset with its pyproject section header read 'tool.flwr.app.config.method'."""
    with pytest.raises(ConfigError, match=f"unknown key; .*{hint}"):
        Config.from_run_config({key: 3})
    preset = tmp_path / "p.toml"
    preset.write_text('[tool.flwr.app.config]\nmethod = "fedprox"\n')
    with pytest.raises(ConfigError, match="a preset holds the keys at its top level, without a header"):
        Config.from_run_config(load_preset(str(preset)))


def test_empty_method_lists_and_parts_are_refused():
    from flowerbed.compare import check_labels

    with pytest.raises(ConfigError, match="at least one method"):
        check_labels([])
    with pytest.raises(ConfigError, match="empty part"):
        check_labels(["fedavg@lr=0.1@"])


def test_fedade_rounds_not_a_multiple_of_the_step_name_the_nearest():
    with pytest.raises(ConfigError, match="multiple of fedade-rounds-per-step \\(2\\), e.g. 4 or 6"):
        Config.from_run_config({"method": "fedade", "num-server-rounds": 5,
                                "fedade-rounds-per-step": 2})


def test_the_server_device_is_the_users_choice_where_given():
    """A GPU review: the ServerApp always took the first GPU (FedFTG's K teachers, FedConcat's
    encoders, Fed-ADE's pre-training), also where the clients' shares filled it."""
    import torch

    from flowerbed.training import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"'server-device' = 'cuda:{n}'.*sees {n} GPU"):
        pick_device(f"cuda:{n}")
