"""docs/adding-a-method.md's example, run as written: registered, trained, crashed, resumed."""

import re
from pathlib import Path

import pytest
from inprocess import run_inprocess

from flowerbed import faults
from flowerbed.registry import METHODS
from flowerbed.results import read_metrics

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-method.md"


def test_the_guides_example_method_runs_and_resumes(tmp_path, monkeypatch):
    """Every ```python block of the guide, in order, then its method through the real ServerApp
    and ClientApp: the server's momentum moves the model (not FedAvg's mean), a run crashed
    after round 1 and resumed equals an unbroken one (its velocity is checkpointed), and a
    ResNet (BatchNorm buffers) trains."""
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S):
        exec(compile(block, str(GUIDE), "exec"), namespace)  # noqa: S102 - our own document
    monkeypatch.setitem(METHODS, "fedavgm", namespace["METHOD"])

    def rc(name, **more):
        return {"method": "fedavgm", "num-server-rounds": 3, "train-samples": 600,
                "test-samples": 200, "min-clients": 2, "batch-size": 64,
                "output-dir": str(tmp_path), "run-name": name,
                "client-state-dir": str(tmp_path / "state"), **more}

    def rows(name):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in read_metrics(tmp_path / name)]

    full = run_inprocess(rc("full"), 2)
    avg = run_inprocess({**rc("fedavg"), "method": "fedavg"}, 2)
    assert full["final-accuracy"] != avg["final-accuracy"]  # the momentum took effect
    with pytest.raises(faults.SimulatedCrash):
        run_inprocess(rc("halt", **{"fault-crash-after": 1}), 2)
    run_inprocess(rc("halt", resume=str(tmp_path / "halt")), 2)
    assert rows("halt") == rows("full")
    # a model with BatchNorm: its buffers keep the mean (momentum on them made the outputs NaN)
    res = run_inprocess(rc("resnet", model="resnet8", **{"num-server-rounds": 2}), 2)
    assert res["final-accuracy"] is not None and not any(r.get("nan-outputs") for r in rows("resnet"))
