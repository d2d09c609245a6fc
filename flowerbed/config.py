"""Run configuration: Flower's run_config -> one typed, validated, frozen object.

This is the only place run-config keys are parsed. Every key and its default lives in
``pyproject.toml`` under ``[tool.flwr.app.config]``; :func:`defaults` reads them from there so that
code outside ``flwr run`` (tests, benchmarks, the launcher) sees the same defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100", "svhn")
MODELS = ("cnn", "resnet8", "resnet18")
PARTITION_KINDS = ("iid", "dirichlet", "pathological", "shards")
FEDX_BASES = ("simclr", "byol", "fedu", "moco", "protocl")
DISTILL_METHODS = ("fedcc", "feddf", "fedmd", "fedct")
#: methods scored by personalised accuracy on the clients' local test splits
PERSONAL_METHODS = ("fedfew", "ifca", "fedsoft", "cfl", "fedrep", "ditto", "apfl", "fedamp", "local",
                    "fedavg-ft")
#: self-supervised methods: trained on pairs of views, scored by a linear probe
SSL_METHODS = ("fedsimclr", "fedbyol", "fedu", "fedmoco", "fedprotocl", "moon-unsup", "fedx")
#: adaptation to unlabelled, shifting streams (Fed-ADE's streams, rounds and online accuracy)
STREAM_METHODS = ("fedade", "fedpoe", "atlas")
MAX_ATLAS_BASES = 64  # ATLAS: each client keeps every base learner, a copy of the model, in its state
MAX_EPSILON = 1e5  # FedXDS: a larger budget is no privacy (give fedxds-sigma for weak noise)
MAX_TIMEOUT = 7 * 24 * 3600
MAX_QUEUE = 65536  # FedMoCo: MoCo's own queue length; each client keeps its queue in memory
MAX_SIGMA = 1e3  # FedXDS: shared samples travel as float16 (at most 65504); a clipped sample's norm is C


class ConfigError(ValueError):
    """A run-config key has a bad value. The message names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        # a command-line flag, a positional argument (RUN_DIR), or a run-config key
        what = "option" if key.startswith("--") else "argument" if key.isupper() else "run-config"
        given = "" if value is True and key.startswith("--") else f" = {value!r}"  # a flag
        super().__init__(f"{what} '{key}'{given} is invalid: {allowed}")
        self.key, self.value, self.allowed = key, value, allowed


@functools.cache
def defaults() -> dict[str, Any]:
    """Every run-config key with its default, as declared in pyproject.toml."""
    with open(PYPROJECT, "rb") as f:
        return dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


#: flwr's own pattern for one ``key=value`` pair (``flwr.common.config.parse_config_args``);
#: flwr drops any text between the pairs, so :func:`parse_overrides` looks for what is left
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def parse_overrides(items: list[str], source: str) -> dict[str, Any]:
    """Run-config overrides in flwr's syntax (``key=value ...`` strings, or TOML file paths),
    parsed by flwr's own parser; a malformed one, or text that is not a ``key=value`` pair
    (flwr would skip it: ``lr = 0.05``, ``momentum``), is a ConfigError naming ``source``."""
    from flwr.common.config import parse_config_args

    keys: list[str] = []  # over every item: `-c lr=0.1 -c lr=0.2` is as ambiguous as one string
    for item in items:
        if item.strip().endswith(".toml"):
            if not Path(item.strip()).is_file():
                raise ConfigError(source, item, "no such TOML file")
        elif stray := _PAIR.sub(" ", item).split():
            raise ConfigError(source, item, f"{' '.join(stray)!r} is not a key=value pair (no "
                              "spaces around '='; strings need quotes, e.g. partition='iid')")
        else:
            keys += [k for k, _ in _PAIR.findall(item)]
            if twice := sorted({k for k in keys if keys.count(k) > 1}):
                raise ConfigError(source, " ".join(items), f"{', '.join(twice)} given twice")
    try:
        return parse_config_args(items)
    except Exception as e:  # noqa: BLE001 - flwr raises click's exception for a malformed string
        first = str(getattr(e, "message", e)).split(". ")[0].rstrip(".")
        raise ConfigError(source, " ".join(items), f"{first}: values are TOML, so strings need "
                          "quotes, and the shell strips them unless the whole argument is quoted: "
                          "-c \"partition='dirichlet:0.1'\"") from None


def load_preset(path: str) -> dict[str, Any]:
    """A preset: an existing TOML file of run-config values."""
    if not Path(path).is_file():
        raise ConfigError("--preset", path, "no such file")
    if not path.endswith(".toml"):
        raise ConfigError("--preset", path, "a preset is a TOML file whose name ends in .toml")
    return parse_overrides([path], "--preset")


_CLIENTS = ("the number of clients is not a run-config key: `flowerbed run/compare "
            "--num-clients`, `deploy up --num-clients`, or num-supernodes in flwr's --federation-config")
#: names users reach for that are not run-config keys, and what sets them instead
NOT_KEYS = {"num-clients": _CLIENTS, "num-supernodes": _CLIENTS, "num-partitions": _CLIENTS,
            "rounds": "did you mean num-server-rounds (the launchers' --rounds)?",
            "num-rounds": "did you mean num-server-rounds (the launchers' --rounds)?",
            "epochs": "did you mean local-epochs?"}
SECTION = ("a TOML section header (e.g. [tool.flwr.app.config]) puts its keys under that name: "
           "a preset holds the keys at its top level, without a header")


@dataclass(frozen=True)
class Partition:
    """A parsed ``partition`` value, e.g. ``dirichlet:0.5``."""

    kind: str
    param: float | int | None = None

    def __str__(self) -> str:
        return self.kind if self.param is None else f"{self.kind}:{self.param}"


#: run-config keys (whole, or the prefix before the first '-') read by some methods only, with
#: the methods reading them; other keys (local-epochs, lr, ...) are every method's. A method
#: left out of a key's readers has that key ignored in a table's rows and differences, so a
#: method missing here hides a real difference: tests/test_resume.py checks that every method's
#: runs read no key outside this. The ServerApp warns of a key set for a method not reading it.
KEY_READERS: dict[str, tuple[str, ...]] = {
    **{m: (m,) for m in ("fedx", "fedcc", "fedfew", "fedsoft", "fedmgda", "cfl", "fedrep", "ditto",
                          "atlas", "fedftg", "fedconcat", "apfl", "fedamp", "feddyn", "scaffold", "fedlc",
                          "fedrs", "fedsam", "fedvls", "fedmr", "fedfed", "feddf")},
    # FedFed shares, noises and trains on D_g as FedXDS does, without attributions and masks
    "fedxds": ("fedxds", "fedfed"),
    **{k: ("fedxds",) for k in ("fedxds-attribution", "fedxds-lrp-first", "fedxds-sparsity", "fedxds-mask",
                                "fedxds-init")},
    "probe": SSL_METHODS, "ssl": SSL_METHODS,
    # NT-Xent's, InfoNCE's, ProtoNCE's mean φ
    "ssl-tau": ("fedsimclr", "fedmoco", "fedprotocl", "moon-unsup", "fedx"),
    "byol": ("fedbyol", "fedu", "fedx"), "moco": ("fedmoco", "fedprotocl", "fedx"), "fedu": ("fedu", "fedx"),
    "protocl": ("fedprotocl", "fedx"), "moon": ("moon-unsup",),
    "distill": DISTILL_METHODS, "hetero": DISTILL_METHODS,
    "distill-epochs": ("fedcc", "feddf", "fedmd"),  # FedCT has no distillation stage (only distill-lr)
    "proximal-mu": ("fedprox", "fedx"),  # FedX: with fedx-global='prox' only
    "scaffold-server-lr": ("scaffold", "fedx"),  # FedX: with fedx-global='scaffold' only
    "finetune": ("fedavg-ft",), "num-models": ("fedfew", "ifca", "fedsoft"),
    "fedade": STREAM_METHODS,  # Fed-POE and ATLAS read the streams', the risk's and the steps'; not:
    **{k: ("fedade",) for k in ("fedade-lr-mode", "fedade-estimators",
                                "fedade-unc", "fedade-rep-ref", "fedade-sync", "fedade-correction")},
    "fedade-fixed-lr": ("fedade", "fedpoe"),

    **{k: ("fedade", "atlas") for k in ("fedade-lr-min", "fedade-lr-max")},  # ATLAS: its step-size pool
}


#: keys every method reads but these: the SGD settings of local training (the distillation
#: methods train with Adam at distill-lr; the stream methods adapt at their own rates on one batch
#: a step, after pre-training by a fixed recipe)
KEY_SKIPPERS: dict[str, tuple[str, ...]] = {
    **{k: DISTILL_METHODS + STREAM_METHODS for k in ("lr", "momentum")},
    **{k: STREAM_METHODS for k in ("local-epochs", "batch-size", "weight-decay")},
}


def reads(method: Any, key: str) -> bool:
    """Whether a run of ``method`` reads run-config ``key``."""
    if method in KEY_SKIPPERS.get(key, ()):
        return False
    readers = KEY_READERS.get(key, KEY_READERS.get(key.split("-", 1)[0]))
    return readers is None or method in readers


#: the most server models (num-models) FedFew, IFCA and FedSoft accept
MAX_MODELS = 100

#: the largest Dirichlet alpha accepted (beyond it the split is iid in all but name)
MAX_ALPHA = 1e6


def parse_partition(text: str) -> Partition:
    """Parse ``iid``, ``dirichlet:<alpha>``, ``pathological:<k>`` or ``shards:<n>``."""
    allowed = "use iid, dirichlet:<alpha > 0>, pathological:<k >= 1>, shards:<n >= 1>"
    kind, _, arg = str(text).strip().partition(":")
    if kind not in PARTITION_KINDS:
        raise ConfigError("partition", text, f"unknown partition kind '{kind}'; {allowed}")
    if kind == "iid":
        if arg:
            raise ConfigError("partition", text, f"iid takes no parameter; {allowed}")
        return Partition("iid")
    try:
        value = float(arg) if kind == "dirichlet" else int(arg)
    except ValueError:
        what = "a number" if kind == "dirichlet" else "a whole number"
        raise ConfigError("partition", text, f"'{arg}' is not {what}; {allowed}") from None
    if kind == "dirichlet" and not (value > 0 and math.isfinite(value)):
        raise ConfigError("partition", text, f"alpha must be a finite number > 0; {allowed}")
    if kind == "dirichlet" and value > MAX_ALPHA:
        # numpy's Dirichlet draw overflows near 1e308; far below that every client already
        # gets the same label mix, which is what iid gives
        raise ConfigError("partition", text, f"alpha above {MAX_ALPHA:g} gives every client the "
                          "same label mix; use iid for that")
    if kind != "dirichlet" and value < 1:
        raise ConfigError("partition", text, f"{kind} needs an integer >= 1; {allowed}")
    return Partition(kind, value)


@dataclass(frozen=True)
class Config:
    """Typed view of the run config. Field names are the keys with '-' replaced by '_'."""

    method: str
    dataset: str
    data_root: str
    partition: Partition
    min_partition_size: int
    local_test_fraction: float
    public_fraction: float
    train_samples: int
    test_samples: int
    model: str
    num_server_rounds: int
    fraction_train: float
    fraction_evaluate: float
    min_clients: int
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    proximal_mu: float
    scaffold_server_lr: float
    eval_every: int
    round_timeout: float
    server_device: str
    seed: int
    probe_every: int
    probe_epochs: int
    probe_lr: float
    probe_batch_size: int
    ssl_tau: float
    ssl_dim: int
    ssl_head_bn: bool
    ssl_augment: str
    byol_ema: float
    moco_momentum: float
    moco_queue: int
    protocl_clusters: str
    protocl_warmup_rounds: int
    fedu_mu: float
    fedx_base: str
    fedx_local_kd: bool
    fedx_global_kd: bool
    fedx_global: str
    fedx_relational: str
    fedx_head: str
    fedx_tau_target: float
    fedx_tau_local: float
    distill_epochs: int
    distill_lr: float
    fedcc_ssl_epochs: int
    fedcc_lambda: float
    fedcc_delta: float
    fedcc_majority: float
    fedcc_probe_input: str
    fedcc_unknown_in_entropy: bool
    fedcc_distill_target: str
    feddf_average: str
    hetero_models: bool
    num_models: int
    fedfew_mu: float
    fedfew_server_lr: float
    fedfew_step: str
    fedfew_distinct_init: bool
    fedfew_eval: str
    fedxds_warmup_rounds: int
    fedxds_attribution: str
    fedxds_lrp_first: str
    fedxds_sparsity: float
    fedxds_mask: str
    fedxds_noise: str
    fedxds_clip: float
    fedxds_sigma: float
    fedxds_epsilon: float
    fedxds_delta: float
    fedxds_share_fraction: float
    fedxds_lambda: float
    fedxds_init: str
    fedade_shift: str
    fedade_schedule: str
    fedade_ber_chain: str
    fedade_ber_p: float
    fedade_rounds_per_step: int
    fedade_batch: int
    fedade_lr_mode: str
    fedade_fixed_lr: float
    fedade_lr_min: float
    fedade_lr_max: float
    fedade_estimators: str
    fedade_unc: str
    fedade_rep_ref: str
    fedade_risk: str
    fedade_correction: str
    fedade_steps: int
    fedade_sync: bool
    fedade_pretrain_epochs: int
    fedade_pixels: str
    fault_fraction: float
    fault_kind: str
    fault_crash_after: int
    moon_mu: float
    moon_tau: float
    cfl_eps1: float
    cfl_eps2: float
    cfl_warmup: int
    fedmgda_epsilon: float
    fedmgda_lr: float
    fedconcat_clusters: int
    fedconcat_encoder_rounds: int
    fedconcat_classifier_steps: int
    fedconcat_classifier_lr: float
    fedfed_lr: float
    fedfed_re: float
    fedfed_ce: float
    fedfed_kl: float
    fedfed_x_ce: float
    fedftg_iterations: int
    fedftg_gen_steps: int
    fedftg_student_steps: int
    fedftg_gen_lr: float
    fedftg_z_dim: int
    fedftg_lambda_md: float
    fedftg_lambda_div: float
    atlas_grid: float
    atlas_meta_lr: float
    atlas_combine: str
    fedsoft_lambda: float
    fedsoft_tau: int
    fedsoft_sigma: float
    fedrep_head_epochs: int
    ditto_lambda: float
    ditto_personal_epochs: int
    apfl_alpha: float
    apfl_adaptive: bool
    apfl_alpha_lr: float
    fedamp_alpha: float
    fedamp_sigma: float
    fedamp_lambda: float
    feddyn_alpha: float
    feddyn_eval: str
    fedlc_tau: float
    fedrs_alpha: float
    fedrs_scaling: str
    fedsam_rho: float
    fedvls_lambda: float
    fedmr_first_stage: int
    finetune_epochs: int
    output_dir: str
    run_name: str
    resume: str
    client_state_dir: str

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any] | None = None, **overrides: Any) -> Config:
        """Merge defaults, Flower's run_config and keyword overrides (kebab-case or snake_case)."""
        merged = dict(defaults())
        merged.update(run_config or {})
        merged.update({k.replace("_", "-"): v for k, v in overrides.items()})
        known = {f.name.replace("_", "-") for f in fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            near = difflib.get_close_matches(unknown[0], known, n=3)
            hint = (NOT_KEYS.get(unknown[0]) or (SECTION if "." in unknown[0] else "")
                    or (f"did you mean {' or '.join(near)}?" if near else
                        "every key and its default: pyproject.toml, [tool.flwr.app.config]"))
            raise ConfigError(unknown[0], merged[unknown[0]], f"unknown key; {hint}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f.name.replace("_", "-")
            values[f.name] = _coerce(key, merged[key], f.type)
        values["partition"] = parse_partition(values["partition"])
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def protocl_ks(self) -> tuple[int, ...]:
        """FedProtoCL's cluster counts, one ProtoNCE term each (``protocl-clusters``)."""
        try:
            ks = tuple(int(k) for k in str(self.protocl_clusters).split(","))
        except ValueError:
            ks = ()
        if not ks or min(ks) < 2:
            raise ConfigError("protocl-clusters", self.protocl_clusters, "a comma-separated list of "
                              "whole numbers >= 2, e.g. 25,50,100")
        return ks

    def validate(self) -> None:
        """Range checks that need no data; data-dependent checks live in ``datasets``."""
        from flowerbed.registry import METHODS  # late import: registry imports strategies

        if self.method not in METHODS:
            near = difflib.get_close_matches(str(self.method).lower(), METHODS, n=1)
            raise ConfigError("method", self.method, (f"did you mean {near[0]}? " if near else "")
                              + f"known methods: {', '.join(sorted(METHODS))}")
        if self.dataset not in DATASETS:
            raise ConfigError("dataset", self.dataset, f"known data sets: {', '.join(DATASETS)}")
        if self.model not in MODELS:
            raise ConfigError("model", self.model, f"known models: {', '.join(MODELS)}")
        if not 0 < self.fraction_train <= 1:
            raise ConfigError("fraction-train", self.fraction_train, "must be in (0, 1]")
        if not 0 <= self.fraction_evaluate <= 1:
            raise ConfigError("fraction-evaluate", self.fraction_evaluate,
                              "must be in [0, 1] (0 = no client-side evaluation)")
        if not 0 <= self.local_test_fraction < 1:
            raise ConfigError("local-test-fraction", self.local_test_fraction, "must be in [0, 1)")
        if self.method in PERSONAL_METHODS and self.local_test_fraction == 0:
            raise ConfigError("local-test-fraction", 0.0, f"{self.method} is scored on the clients' "
                              "local test splits: set it > 0 (the FedFew paper: 0.25)")
        if ((self.method in PERSONAL_METHODS + DISTILL_METHODS + STREAM_METHODS)
                and self.fraction_evaluate == 0
                and not (self.method == "fedfew" and self.fedfew_eval == "local")):
            raise ConfigError("fraction-evaluate", 0.0, f"{self.method} is scored by its clients' "
                              "evaluation: set it > 0")
        positive_ints = ("num-server-rounds", "local-epochs", "batch-size", "eval-every", "min-clients",
                         "probe-every", "probe-epochs", "probe-batch-size", "ssl-dim", "num-models",
                         "moco-queue",
                         "fedade-rounds-per-step", "fedade-batch", "fedade-steps", "fedade-pretrain-epochs",
                         "fedxds-warmup-rounds",  # FedXDS shares in its last warm-up round
                         "ditto-personal-epochs", "fedsoft-tau", "fedftg-gen-steps", "fedftg-student-steps",
                         "fedftg-z-dim", "fedconcat-clusters", "fedconcat-encoder-rounds",
                         "fedconcat-classifier-steps")
        for key in ("distill-epochs", "fedcc-ssl-epochs", "fedrep-head-epochs", "finetune-epochs",
                    "fedmr-first-stage", "protocl-warmup-rounds", "cfl-warmup", "fedftg-iterations"):
            if getattr(self, key.replace("-", "_")) < 0:
                raise ConfigError(key, getattr(self, key.replace("-", "_")), "must be an integer >= 0")
        for key in positive_ints:
            v = getattr(self, key.replace("-", "_"))
            if v < 1:
                raise ConfigError(key, v, "must be an integer >= 1")
        for key in ("train-samples", "test-samples", "min-partition-size"):
            v = getattr(self, key.replace("-", "_"))
            if v < 0:
                raise ConfigError(key, v, "must be an integer >= 0 (" + (
                    "0: no minimum, though a client with no samples is still refused"
                    if key == "min-partition-size" else "0: the whole split") + ")")
        if not 0 <= self.public_fraction < 1:
            raise ConfigError("public-fraction", self.public_fraction, "must be in [0, 1)")
        if self.method in DISTILL_METHODS and self.public_fraction == 0:
            raise ConfigError("public-fraction", self.public_fraction,
                              f"{self.method} needs a public set: set it > 0 (the FedCC paper: 0.1)")
        if self.fedcc_probe_input not in ("mean", "black", "white"):
            raise ConfigError("fedcc-probe-input", self.fedcc_probe_input, "use mean, black or white")
        if self.fedcc_distill_target not in ("pad", "known"):
            raise ConfigError("fedcc-distill-target", self.fedcc_distill_target, "use pad or known")
        if self.feddf_average not in ("probabilities", "logits"):
            raise ConfigError("feddf-average", self.feddf_average, "use probabilities or logits")
        for key in ("fedcc-delta", "fedcc-majority"):
            v = getattr(self, key.replace("-", "_"))
            if not 0 <= v < 1:
                raise ConfigError(key, v, "must be in [0, 1)")
        if self.fedxds_attribution not in ("lrp", "ig", "ixg", "smoothgrad"):
            raise ConfigError("fedxds-attribution", self.fedxds_attribution, "use lrp, ig, ixg or smoothgrad")
        if self.fedxds_lrp_first not in ("flat", "alpha1beta0"):
            raise ConfigError("fedxds-lrp-first", self.fedxds_lrp_first, "use flat or alpha1beta0")
        if self.fedxds_mask not in ("binary", "soft", "none"):
            raise ConfigError("fedxds-mask", self.fedxds_mask, "use binary, soft or none")
        if self.fedxds_init not in ("scratch", "warmup"):
            raise ConfigError("fedxds-init", self.fedxds_init, "use scratch or warmup")
        if self.fedxds_noise not in ("secret", "seeded"):
            raise ConfigError("fedxds-noise", self.fedxds_noise, "use secret or seeded")
        if not (0 <= self.fedxds_sparsity < 1 and round(784 * (1 - self.fedxds_sparsity)) > 0):
            raise ConfigError("fedxds-sparsity", self.fedxds_sparsity, "must be in [0, 1) and "
                              "keep at least one pixel of a 28x28 image (< 0.999)")
        if not 0 < self.fedxds_share_fraction <= 1:
            raise ConfigError("fedxds-share-fraction", self.fedxds_share_fraction, "must be in (0, 1]")
        if not 0 < self.fedxds_delta < 1:
            raise ConfigError("fedxds-delta", self.fedxds_delta, "must be in (0, 1)")
        if not 0 <= self.fedxds_epsilon <= MAX_EPSILON:  # opacus' search never ends at 1e15
            raise ConfigError("fedxds-epsilon", self.fedxds_epsilon, f"must be in [0, {MAX_EPSILON:g}] "
                              "(0: noise from fedxds-sigma)")
        if self.fedxds_epsilon == 0 and not self.fedxds_sigma > 0:
            raise ConfigError("fedxds-sigma", self.fedxds_sigma,
                              "noise is mandatory: give sigma > 0 or epsilon > 0")
        if self.fedxds_sigma > MAX_SIGMA:
            raise ConfigError("fedxds-sigma", self.fedxds_sigma, f"must be <= {MAX_SIGMA:g} (shared "
                              "samples travel as float16; a clipped sample's norm is fedxds-clip)")
        if self.method in ("fedxds", "fedfed") and self.fedxds_warmup_rounds >= self.num_server_rounds:
            raise ConfigError("fedxds-warmup-rounds", self.fedxds_warmup_rounds,
                              f"must be < num-server-rounds ({self.num_server_rounds})")
        if ((self.method == "fedprotocl" or (self.method == "fedx" and self.fedx_base == "protocl"))
                and self.protocl_warmup_rounds >= self.num_server_rounds):
            raise ConfigError("protocl-warmup-rounds", self.protocl_warmup_rounds,
                              f"must be < num-server-rounds ({self.num_server_rounds}): no round would "
                              "use the prototypes (0 uses them from round 1)")
        choices = {"fedade-shift": ("label", "covariate"), "fedade-schedule": ("lin", "sin", "squ", "ber"),
                   "fedade-ber-chain": ("shared", "client"),
                   "fedade-lr-mode": ("adaptive", "fixed", "none"),
                   "fedade-estimators": ("both", "unc", "rep"), "fedade-unc": ("softmax", "hist"),
                   "fedade-rep-ref": ("previous", "ema"), "fedade-risk": ("entropy", "bbse"),
                   "fedade-correction": ("none", "fth"), "atlas-combine": ("weight", "output"),
                   "fedade-pixels": ("standardised", "raw"),
                   "ssl-augment": ("auto", "per-sample", "batched"),
                   "feddyn-eval": ("served", "average")}
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.server_device):
            raise ConfigError("server-device", self.server_device, "use auto | cpu | cuda | cuda:N")
        for key, allowed in choices.items():
            if getattr(self, key.replace("-", "_")) not in allowed:
                raise ConfigError(key, getattr(self, key.replace("-", "_")), f"use {' | '.join(allowed)}")
        if self.method == "fedade" and self.fedade_correction == "fth" and self.fedade_lr_mode != "none":
            raise ConfigError("fedade-correction", "fth", "FTH reweights the predictions of a model it "
                              f"never trains: set fedade-lr-mode='none' (not '{self.fedade_lr_mode}')")
        if not 0 <= self.fedade_ber_p <= 1:
            raise ConfigError("fedade-ber-p", self.fedade_ber_p, "must be a probability in [0, 1]")
        if self.fedade_fixed_lr < 0:
            raise ConfigError("fedade-fixed-lr", self.fedade_fixed_lr, "must be >= 0")
        steps = self.num_server_rounds // self.fedade_rounds_per_step
        if self.method in STREAM_METHODS and self.fedade_schedule == "sin" and steps < 10:
            raise ConfigError("fedade-schedule", "sin", f"needs at least 10 time steps (its period is "
                              f"floor(sqrt(T - 1)), and below 3 every step has w = 0.5: no shift); "
                              f"num-server-rounds / fedade-rounds-per-step gives {steps}")
        if self.method in STREAM_METHODS and self.num_server_rounds % self.fedade_rounds_per_step:
            k, r = self.fedade_rounds_per_step, self.num_server_rounds
            near = sorted({max(k, r // k * k), (r // k + 1) * k})
            raise ConfigError("num-server-rounds", r, f"must be a multiple of fedade-rounds-per-step "
                              f"({k}), e.g. {' or '.join(map(str, near))}")
        if self.method in SSL_METHODS and self.batch_size < 2:  # a contrastive pair needs two
            raise ConfigError("batch-size", self.batch_size, f"{self.method} needs at least 2 "
                              "images a batch (a batch of one is skipped: nothing would train)")
        if "/" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError("run-name", self.run_name, "a folder name inside output-dir, "
                              "without '/' (set output-dir for another place)")
        if self.seed < 0:  # numpy's SeedSequence takes non-negative integers only
            raise ConfigError("seed", self.seed, "must be >= 0")
        if not 0 <= self.fault_fraction <= 1:
            raise ConfigError("fault-fraction", self.fault_fraction, "must be in [0, 1]")
        if self.fault_kind not in ("raise", "nan", "shape", "hang", "mixed"):
            raise ConfigError("fault-kind", self.fault_kind, "use raise, nan, shape, hang or mixed")
        if self.fault_crash_after < 0:
            raise ConfigError("fault-crash-after", self.fault_crash_after, "must be >= 0 (0 = off)")
        if self.fedfew_eval not in ("server", "local"):
            raise ConfigError("fedfew-eval", self.fedfew_eval, "use server or local")
        if self.fedfew_step not in ("paper", "normalised"):
            raise ConfigError("fedfew-step", self.fedfew_step, "use paper or normalised")
        if self.fedx_base not in FEDX_BASES:
            raise ConfigError("fedx-base", self.fedx_base, f"known bases: {', '.join(FEDX_BASES)}")
        if self.fedx_relational not in ("official", "js"):
            raise ConfigError("fedx-relational", self.fedx_relational, "use official or js")
        if self.fedx_global not in ("kd", "prox", "scaffold"):
            raise ConfigError("fedx-global", self.fedx_global, "use kd, prox or scaffold")
        if self.method == "fedx" and self.fedx_global != "kd" and not self.fedx_global_kd:
            raise ConfigError("fedx-global", self.fedx_global, f"the {self.fedx_global} regulariser "
                              "takes the global KD terms' place, "
                              "which fedx-global-kd=false switches off: set fedx-global-kd=true, or "
                              "leave fedx-global at 'kd' for the run without any global term")
        if self.method == "fedx" and self.fedx_global == "prox" and self.proximal_mu == 0:
            raise ConfigError("proximal-mu", 0.0, "fedx-global='prox' needs a pull > 0 (0 is FedX "
                              "without global terms: fedx-global-kd=false)")
        if self.fedx_head not in ("shared", "separate"):
            raise ConfigError("fedx-head", self.fedx_head, "use shared or separate")
        if self.fedx_head == "separate" and self.method == "fedx" and self.fedx_global != "kd":
            raise ConfigError("fedx-head", self.fedx_head, f"'separate' serves FedX's global KD terms only, "
                              f"which fedx-global='{self.fedx_global}' replaces: leave fedx-head at 'shared'")
        if self.fedx_head == "separate" and (self.method != "fedx" or self.fedx_base not in ("byol", "fedu")):
            raise ConfigError("fedx-head", self.fedx_head, "'separate' needs method='fedx' with "
                              "fedx-base='byol' or 'fedu' (over SimCLR and MoCo the prediction head "
                              "serves only FedX's global terms already)")
        for key in ("lr", "scaffold-server-lr", "round-timeout", "probe-lr", "ssl-tau",
                    "fedx-tau-target", "fedx-tau-local", "fedu-mu", "distill-lr", "fedfew-mu",
                    "fedfew-server-lr", "fedxds-clip", "fedamp-alpha", "fedamp-sigma", "fedamp-lambda",
                    "feddyn-alpha", "fedsam-rho", "fedmgda-lr", "cfl-eps1", "cfl-eps2",
                    "moon-tau", "atlas-meta-lr", "fedftg-gen-lr", "fedfed-lr"):
            v = getattr(self, key.replace("-", "_"))
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(key, v, "must be a finite number > 0")
        if self.num_models > MAX_MODELS:  # 1000 copies of the CNN failed to allocate (6.5 GB)
            raise ConfigError("num-models", self.num_models, f"must be <= {MAX_MODELS}: every round "
                              "sends all K models to every client (FedFew's paper uses K <= 10)")
        if self.ssl_dim > 8192:  # the heads' width: 2**30 failed to allocate in the ServerApp
            raise ConfigError("ssl-dim", self.ssl_dim, "must be <= 8192 (FedX uses 512)")
        if self.round_timeout > MAX_TIMEOUT:
            raise ConfigError("round-timeout", self.round_timeout, f"must be <= {MAX_TIMEOUT:g} s (a week)")
        if self.fedrs_scaling not in ("absent", "proportional"):
            raise ConfigError("fedrs-scaling", self.fedrs_scaling, "use absent or proportional")
        if not 0 <= self.fedrs_alpha <= 1:
            raise ConfigError("fedrs-alpha", self.fedrs_alpha,
                              "must be in [0, 1] (the scale of the absent classes' logits; 1 is FedAvg)")
        if not 0 <= self.fedmgda_epsilon <= 1:
            raise ConfigError("fedmgda-epsilon", self.fedmgda_epsilon,
                              "must be in [0, 1] (how far a client's weight may move from its sample share)")
        if not 0 < self.fedsoft_sigma <= 1:
            raise ConfigError("fedsoft-sigma", self.fedsoft_sigma,
                              "must be in (0, 1] (the smallest importance weight; the official code: 1e-4)")
        if not 0 <= self.apfl_alpha <= 1:
            raise ConfigError("apfl-alpha", self.apfl_alpha,
                              "must be in [0, 1] (the weight of the personal model)")
        if self.moco_queue > MAX_QUEUE:
            raise ConfigError("moco-queue", self.moco_queue, f"must be <= {MAX_QUEUE} (MoCo's own queue)")
        self.protocl_ks()  # raises on a malformed list
        for key in ("momentum", "byol-ema", "moco-momentum"):
            v = getattr(self, key.replace("-", "_"))
            if not 0 <= v < 1:
                raise ConfigError(key, v, "must be in [0, 1)")
        for key in ("weight-decay", "proximal-mu", "ditto-lambda", "apfl-alpha-lr", "fedcc-lambda",
                    "fedxds-lambda", "fedxds-sigma", "fedxds-epsilon", "fedade-fixed-lr", "fedade-lr-min",
                    "fedade-lr-max", "fedlc-tau", "fedvls-lambda", "fedsoft-lambda",
                    "moon-mu", "fedftg-lambda-md", "fedftg-lambda-div", "fedconcat-classifier-lr",
                    "fedfed-re", "fedfed-ce", "fedfed-kl", "fedfed-x-ce"):
            v = getattr(self, key.replace("-", "_"))
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(key, v, "must be a finite number >= 0")
        if self.fedade_lr_min > self.fedade_lr_max:  # named: the one changed from its default
            if self.fedade_lr_max != defaults()["fedade-lr-max"]:
                raise ConfigError("fedade-lr-max", self.fedade_lr_max,
                                  f"must be >= fedade-lr-min = {self.fedade_lr_min}")
            raise ConfigError("fedade-lr-min", self.fedade_lr_min,
                              f"must be in [0, fedade-lr-max = {self.fedade_lr_max}]")

        if self.method == "atlas":
            self.atlas_pool()  # raises where the pool cannot be built
        if self.method == "fedconcat" and self.fedconcat_encoder_rounds >= self.num_server_rounds:
            raise ConfigError("fedconcat-encoder-rounds", self.fedconcat_encoder_rounds,
                              f"must be < num-server-rounds ({self.num_server_rounds}): the rounds after "
                              "it train the classifier, and the global model needs at least one")
        if self.method == "fedconcat" and self.fedconcat_clusters > MAX_MODELS:
            raise ConfigError("fedconcat-clusters", self.fedconcat_clusters, f"must be <= {MAX_MODELS}: "
                              "every classifier round sends all K models to every client")

    def atlas_pool(self) -> list[float]:
        """ATLAS's step sizes: fedade-lr-min·g^k while <= fedade-lr-max, then one more (the
        official code's pool), g = atlas-grid."""
        if not (self.atlas_grid > 1 and math.isfinite(self.atlas_grid)):
            raise ConfigError("atlas-grid", self.atlas_grid, "must be a finite number > 1 (the ratio "
                              "of neighbouring step sizes in the pool; the official code: 2)")
        if self.fedade_lr_min <= 0:
            raise ConfigError("fedade-lr-min", self.fedade_lr_min, "must be > 0 for ATLAS (its pool "
                              "of step sizes is geometric, from fedade-lr-min up)")
        pool, eta = [], self.fedade_lr_min
        while eta <= self.fedade_lr_max:
            pool.append(eta)
            eta *= self.atlas_grid
            if len(pool) >= MAX_ATLAS_BASES:
                raise ConfigError("atlas-grid", self.atlas_grid, f"gives more than {MAX_ATLAS_BASES} "
                                  f"base learners from fedade-lr-min {self.fedade_lr_min:g} to fedade-lr-max "
                                  f"{self.fedade_lr_max:g} (each is a copy of the model that every client "
                                  "keeps): a larger atlas-grid or a narrower range")
        return [*pool, eta]

    def resolved_sigma(self) -> float:
        """FedXDS noise std: ``fedxds-sigma``, or calibrated from (epsilon, delta) when epsilon > 0
        (opacus finds none above about 26, far below :data:`MAX_SIGMA`)."""
        if self.fedxds_epsilon == 0:
            return self.fedxds_sigma
        from flowerbed.privacy import sigma_for

        try:
            return sigma_for(self.fedxds_epsilon, self.fedxds_delta)
        except ValueError as e:  # opacus: "The privacy budget is too low."
            raise ConfigError("fedxds-epsilon", self.fedxds_epsilon, f"opacus finds no noise "
                              f"level for it at fedxds-delta = {self.fedxds_delta:g} ({e} "
                              "Its RDP accountant, whose orders stop at 63, certifies no epsilon "
                              "below about 0.11 at delta 1e-5, whatever the noise); raise "
                              "fedxds-epsilon or fedxds-delta") from None

    def to_run_config(self) -> dict[str, Any]:
        """Back to Flower's flat kebab-case dict (what ``--run-config`` takes)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name.replace("_", "-")] = str(v) if isinstance(v, Partition) else v
        return out

    def replace(self, **changes: Any) -> Config:
        """A copy with some fields changed (validated again)."""
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg


def normalised(key: str, value: Any) -> Any:
    """``value`` of run-config ``key`` as a Config holds it ('dirichlet:1' as 'dirichlet:1.0',
    600.0 as 600), checked on its own (not against other keys); a ConfigError where it is no
    value of that key."""
    types = {f.name.replace("_", "-"): f.type for f in fields(Config)}
    if key not in types:
        raise ConfigError(key, value, "unknown key")
    value = _coerce(key, value, types[key])
    return str(parse_partition(value)) if key == "partition" else value


def normalised_settings(exported: dict[str, Any]) -> dict[str, Any]:
    """An export's split settings as the run config writes them ('dirichlet:1' as
    'dirichlet:1.0', 600.0 as 600), each on its own; a value that is no value of its key as it is."""
    out = {}
    for k, v in exported.items():
        try:
            out[k] = normalised(k, v)
        except ConfigError:
            out[k] = v
    return out


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML value to the field's type, or raise a ConfigError naming the key."""
    name = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    if name == "bool":
        if not isinstance(value, bool):
            raise ConfigError(key, value, "expected true or false")
        return value
    if isinstance(value, bool) and name in ("int", "float"):
        raise ConfigError(key, value, f"expected a number ({name}), got a boolean")
    if name in ("int", "float") and not isinstance(value, int | float):
        raise ConfigError(key, value, f"expected a number ({name}), got {type(value).__name__}")
    if name in ("str", "Partition") and isinstance(value, int | float) and not isinstance(value, bool):
        example = f"{key}='dirichlet:{value}'" if name == "Partition" else f"{key}='{value}'"
        raise ConfigError(key, value, f"expected a string: quote it, {example}")
    try:
        if name == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            out = int(value)
        elif name == "float":
            out = float(value)
        elif name in ("str", "Partition"):
            if not isinstance(value, str):
                raise ValueError
            out = value
        else:
            return value
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(key, value, f"expected a value of type {name}") from None
    if name == "int" and not -INT_LIMIT < out < INT_LIMIT:  # Flower, numpy and torch take 64 bits;
        raise ConfigError(key, value, "must be below 2**31 in size")  # seeds are combined below
    if name == "float" and math.isfinite(out) and abs(out) > FLOAT_LIMIT:
        raise ConfigError(key, value, f"out of range: at most {FLOAT_LIMIT:g} in size (models and "
                          "data are float32)")
    if isinstance(out, str) and any(ord(c) < 32 or ord(c) == 127 for c in out):
        raise ConfigError(key, value, "a string value may not contain control characters (a NUL "
                          "ended a run in a bare 'embedded null byte' error)")
    if isinstance(out, str) and '"' in out:
        raise ConfigError(key, value, "a string value may not contain '\"' (Flower's run config "
                          "cannot carry it)")
    return out


INT_LIMIT, FLOAT_LIMIT = 2 ** 31, 1e30
