"""FedLC, FedRS, FedSAM and FedVLS (FedCC paper baselines): FedAvg with another local step, by hand."""

import copy
import math

import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict

import flowerbed.clients.base as base
from flowerbed.config import Config, ConfigError
from flowerbed.registry import METHODS
from flowerbed.training import to_record
from tests.conftest import sent

CE = torch.nn.functional.cross_entropy

SMALL = {"train-samples": 600, "test-samples": 100, "batch-size": 32, "partition": "pathological:2"}


def client_and_hook(method, monkeypatch, hook="criterion", **extra):
    """The client of partition 0 (two classes) and the hooks its fit hands to training (the
    named one alone by default)."""
    cfg = Config.from_run_config({**SMALL, "method": method, **extra})
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 5},
                  state=RecordDict(), run_config=cfg.to_run_config())
    client = METHODS[method].client(cfg, ctx)
    seen = {}

    def fake_train(model, data, **kw):  # only what fit passes on is under test here
        seen.update(kw, model=model)
        return 0.0, 1

    monkeypatch.setattr(base, "train_epochs", fake_train)
    model = client.new_model()
    client.fit(model, sent(3, RecordDict({"config": ConfigRecord({"server-round": 1})})), 1)
    return client, seen[hook] if hook else seen


def test_fedlc_calibrates_logits_by_the_clients_class_counts(monkeypatch):
    client, hook = client_and_hook("fedlc", monkeypatch, **{"fedlc-tau": 0.5})
    counts = torch.bincount(client.train_data.y, minlength=10)
    assert int((counts > 0).sum()) == 2  # pathological:2
    z, y = torch.randn(3, 10), torch.tensor([0, 4, 9])
    shift = torch.tensor([-0.5 * (int(n) ** -0.25 if n else 1e-8 ** -0.25) for n in counts])  # absent: -50
    assert float(hook(z, y)) == pytest.approx(float(CE(z + shift, y)), rel=1e-5)
    # a sample of a present class: the cross-entropy over its client's two classes, about, as
    # the absent classes' logits lie 50 below and drop out of the softmax
    a, b = [int(c) for c in torch.nonzero(counts).flatten()]
    want = -math.log(1 / (1 + math.exp(0.5 * (counts[a] ** -0.25 - counts[b] ** -0.25))))
    assert float(hook(torch.zeros(1, 10), torch.tensor([a]))) == pytest.approx(want, rel=1e-4)


def test_fedrs_scales_the_absent_classes_logits(monkeypatch):
    client, hook = client_and_hook("fedrs", monkeypatch, **{"fedrs-alpha": 0.25})
    present = torch.bincount(client.train_data.y, minlength=10) > 0
    z, y = torch.randn(2, 10), torch.tensor([1, 7])
    scaled = torch.where(present, z, 0.25 * z)
    assert float(hook(z, y)) == pytest.approx(float(CE(scaled, y)), rel=1e-6)
    counts = torch.bincount(client.train_data.y, minlength=10).float()
    _, hook = client_and_hook("fedrs", monkeypatch, **{"fedrs-alpha": 0.25, "fedrs-scaling": "proportional"})
    want = CE(z * (0.25 + 0.75 * counts / counts.max()), y)  # the authors' code: rare classes too
    assert float(hook(z, y)) == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ConfigError, match="'fedrs-scaling' = 'soft'"):
        Config.from_run_config({"method": "fedrs", "fedrs-scaling": "soft"})
    _, hook = client_and_hook("fedrs", monkeypatch, **{"fedrs-alpha": 1.0})
    assert float(hook(z, y)) == float(CE(z, y))  # alpha = 1 is FedAvg


def test_each_trains_through_a_real_round_and_bad_settings_are_refused():
    for method in ("fedlc", "fedrs", "fedsam", "fedvls"):
        cfg = Config.from_run_config({**SMALL, "method": method})
        ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 0, "num-partitions": 5},
                      state=RecordDict(), run_config=cfg.to_run_config())
        client = METHODS[method].client(cfg, ctx)
        arrays = to_record(client.new_model())
        msg = sent(3, RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}))
        out = client.train(msg)
        assert math.isfinite(out.content["metrics"]["train-loss"])
    with pytest.raises(ConfigError, match="'fedrs-alpha' = 1.5"):
        Config.from_run_config({"method": "fedrs", "fedrs-alpha": 1.5})
    with pytest.raises(ConfigError, match="'fedlc-tau' = -1"):
        Config.from_run_config({"method": "fedlc", "fedlc-tau": -1.0})
    with pytest.raises(ConfigError, match="'fedsam-rho' = 0"):
        Config.from_run_config({"method": "fedsam", "fedsam-rho": 0.0})
    with pytest.raises(ConfigError, match="'fedvls-lambda' = -1"):
        Config.from_run_config({"method": "fedvls", "fedvls-lambda": -1.0})


def test_fedsam_takes_the_gradient_at_the_perturbed_weights(monkeypatch):
    _, hooks = client_and_hook("fedsam", monkeypatch, hook=None, **{"fedsam-rho": 0.3})
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    w0 = [p.detach().clone() for p in m.parameters()]

    def grads_at(ws):
        probe = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for p, w in zip(probe.parameters(), ws, strict=True):
                p.copy_(w)
        CE(probe(x), y).backward()
        return [p.grad for p in probe.parameters()]

    g = grads_at(w0)
    norm = math.sqrt(sum(float((t ** 2).sum()) for t in g))
    want = grads_at([w + 0.3 * t / norm for w, t in zip(w0, g, strict=True)])
    hooks["batch_hook"](x, y)
    CE(m(x), y).backward()
    hooks["grad_hook"](m)
    for p, w, gw in zip(m.parameters(), w0, want, strict=True):
        assert torch.equal(p.detach(), w)  # the weights are back at w
        assert torch.allclose(p.grad, gw, atol=1e-6)  # with the gradient at w + eps


def test_train_epochs_trains_on_the_methods_criterion_and_evaluation_on_cross_entropy():
    from flowerbed.datasets.loading import DataSet
    from flowerbed.training import evaluate, train_epochs

    torch.manual_seed(0)
    x = torch.randint(0, 255, (8, 1, 4, 4), dtype=torch.uint8)
    data = DataSet("fashion-mnist", x, torch.arange(8) % 4, 4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
    loss, _ = train_epochs(model, data, epochs=1, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0,
                           device=torch.device("cpu"), generator=torch.Generator().manual_seed(0),
                           criterion=lambda z, y: CE(z * 0, y))
    assert loss == pytest.approx(math.log(4), rel=1e-6)  # all-zero logits: uniform over 4 classes
    assert evaluate(model, data, torch.device("cpu"))[0] != pytest.approx(math.log(4), rel=1e-3)


def test_fedvls_loss_by_hand():
    from flowerbed.clients.fedvls import vls_loss

    torch.manual_seed(1)
    z, t = torch.randn(3, 4), torch.randn(3, 4)
    y = torch.tensor([0, 1, 1])
    prior = torch.tensor([0.25, 0.75, 0.0, 0.0])  # classes 2, 3 vacant
    lp = [math.log(p + 1e-9) for p in prior.tolist()]
    ce = sum(-math.log(math.exp(z[i, y[i]] + lp[y[i]]) / sum(math.exp(z[i, c] + lp[c]) for c in range(4)))
             for i in range(3)) / 3
    sup = 0.0
    for c in range(4):  # a sample of class c enters class c's logsumexp as 0 (the code's mask)
        vals = [(float(z[i, c]) - lp[c] - math.log(4)) if int(y[i]) != c else 0.0 for i in range(3)]
        sup += float(prior[c]) * (math.log(sum(math.exp(v) for v in vals)) - math.log(3))
    kd = 0.0
    for i in range(3):
        ps = torch.softmax(z[i, 2:], 0).tolist()
        pt = torch.softmax(t[i, 2:], 0).tolist()
        kd += sum(b * (math.log(b) - math.log(a)) for a, b in zip(ps, pt, strict=True))
    want = ce + 0.005 * sup + 0.7 * kd / 3
    assert float(vls_loss(z, y, t, prior, 0.7)) == pytest.approx(want, rel=1e-5)
    # no vacant class: no distillation term
    full = torch.tensor([0.25, 0.25, 0.25, 0.25])
    assert torch.isfinite(vls_loss(z, y, t, full, 0.7))
    assert float(vls_loss(z, y, t, full, 0.7)) == pytest.approx(float(vls_loss(z, y, t, full, 0.0)))


def test_fedvls_distils_from_the_frozen_received_model(monkeypatch):
    from flowerbed.clients.fedvls import vls_loss

    client, hooks = client_and_hook("fedvls", monkeypatch, hook=None, **{"fedvls-lambda": 0.7})
    model = hooks["model"]
    x, y = client.train_data.normalise(client.train_data.x[:4]), client.train_data.y[:4]
    with torch.no_grad():
        teacher = copy.deepcopy(model).train()(x)  # the received model, in train mode
        for p in model.parameters():  # training moves the local model; the teacher stays
            p.add_(1.0)
    counts = torch.bincount(client.train_data.y, minlength=10).float()
    hooks["batch_hook"](x, y)
    z = torch.randn(4, 10, requires_grad=True)
    loss = hooks["criterion"](z, y)
    prior = counts / counts.sum()
    assert loss.item() == pytest.approx(vls_loss(z, y, teacher, prior, 0.7).item(), rel=1e-6)
    # the distillation: the vacant classes' gradient is the lambda-weighted KL's (cross-entropy
    # gives them about nothing: their prior-corrected logits sit at log 1e-9)
    loss.backward()
    vacant = counts == 0
    g = z.grad[:, vacant].clone()
    z.grad = None
    vls_loss(z, y, teacher, prior, 0.0).backward()
    assert g.abs().sum() > 1e3 * z.grad[:, vacant].abs().sum()
    z.grad = None
    t = teacher.clone().requires_grad_(True)  # z = t: no distillation gradient
    vls_loss(t, y, teacher, prior, 0.7).backward()
    g_kd = t.grad[:, vacant].clone()
    t.grad = None
    vls_loss(t, y, teacher, prior, 0.0).backward()
    assert torch.allclose(g_kd, t.grad[:, vacant], atol=1e-7)
