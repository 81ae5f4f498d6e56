"""Unchanged torch_xla scripts: ``import torchacc.alias`` / ``python -m torchacc.run_torch_xla``."""

import json
import math
import os
import sys
from pathlib import Path

import prewarmed
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code_or_args, timeout=240):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    return prewarmed.run([*code_or_args], env=env, cwd=ROOT, timeout=timeout)


def test_alias_resolves_torch_xla_modules():
    import importlib

    import torchacc.alias
    import torchacc.torch_xla
    import torchacc.torch_xla.core.xla_model

    torchacc.alias.install()
    try:
        torch_xla = importlib.import_module("torch_xla")
        xm = importlib.import_module("torch_xla.core.xla_model")
        xr = importlib.import_module("torch_xla.runtime")
        amp = importlib.import_module("torch_xla.amp")
        syncfree = importlib.import_module("torch_xla.amp.syncfree")
        for name in (
            "torch_xla.debug.metrics",
            "torch_xla.utils.utils",
            "torch_xla.distributed.xla_multiprocessing",
        ):
            importlib.import_module(name)
        assert torch_xla is torchacc.torch_xla
        assert xm is torchacc.torch_xla.core.xla_model and torch_xla.core.xla_model is xm
        assert xm.__spec__.name == "torchacc.torch_xla.core.xla_model"
        assert amp.syncfree is syncfree and syncfree.AdamW is torchacc.amp.syncfree.AdamW
        assert xm.xla_device().type == "torchacc" and xr.world_size() == 1
        with pytest.raises(ImportError):
            importlib.import_module("torch_xla.no_such_module")
    finally:
        torchacc.alias.uninstall()
    assert "torch_xla" not in sys.modules and "torch_xla.core.xla_model" not in sys.modules
    # the torchacc modules themselves are untouched
    assert sys.modules["torchacc.torch_xla.core.xla_model"].__name__.startswith("torchacc.")


def test_run_torch_xla_usage_errors(capsys, monkeypatch):
    from torchacc import run_torch_xla

    monkeypatch.delenv("TORCHACC_DEVICE_TYPE", raising=False)
    assert run_torch_xla.main([]) == 2
    assert "usage" in capsys.readouterr().err
    assert run_torch_xla.main(["no/such/script.py"]) == 2
    assert "no such script" in capsys.readouterr().err
    # called in a process whose device is named torchacc, it leaves the environment alone (an
    # exported name would follow every later child, run_torch_xla's own included)
    assert "TORCHACC_DEVICE_TYPE" not in os.environ


@pytest.mark.slow
def test_mnist_style_torch_xla_script_runs_unchanged(tmp_path):
    out = tmp_path / "result.json"
    res = _run(
        [
            "-m",
            "torchacc.run_torch_xla",
            "tests/torch_xla_mnist.py",
            "--both",
            "--steps",
            "6",
            "--out",
            str(out),
        ]
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    result = json.loads(out.read_text())
    for mode in ("fp32", "amp"):
        losses = result[mode]
        assert len(losses) == 6, f"{mode}: step closures ran {len(losses)} times"
        assert all(math.isfinite(v) for v in losses)
        assert losses[-1] < losses[0], f"{mode} loss did not decrease: {losses}"
    counters = result["counters"]
    assert counters["MarkStep"] >= 12
    # the only host reads are the step closures' loss.item(): AMP + syncfree adds none
    assert counters["TransferFromDevice"] == 12, counters
    assert not [n for n in counters if n.startswith("aten::")], counters
    assert "step 5 loss" in res.stdout
