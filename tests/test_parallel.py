"""torchacc.parallel (MindSpore-style parallel modes) on 4 CPU devices, and its checkpoint slices
reloaded on 2 devices and on 1 (STAND_ALONE, for inference or further training).

The cases live in tests/spmd_cases/ and run in fresh processes: the device count
(``CPU_NUM_DEVICES``) must be set before JAX starts, and SPMD mode is for the whole process.
"""

import json
import os
import sys

import pytest
import torch
from test_spmd import run_cases

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "spmd_cases"))


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_parallel")
def test_parallel_cases_on_4_devices_and_checkpoints_on_2_and_1(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALLEL_CKPT_DIR", str(tmp_path))
    out = run_cases("case_parallel.py")
    assert " passed" in out and "failed" not in out
    out = run_cases("case_parallel_reload.py", devices=2)
    assert "1 passed" in out

    # one device, STAND_ALONE: the same slice files into a plain CPU model
    import ckpt_model

    import torchacc.parallel as par

    assert par.get_auto_parallel_context("parallel_mode") == par.ParallelMode.STAND_ALONE
    torch.manual_seed(2)
    model = ckpt_model.Wide()
    opt = ckpt_model.optimizer(model)
    files = [str(tmp_path / "slices" / f"device_{d}.ckpt") for d in range(4)]
    par.load_distributed_checkpoint(model, files, optimizer=opt)
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)["tensors"]
    for name, t in model.state_dict().items():
        assert torch.equal(t, full[name]), name
    expect = json.loads((tmp_path / "losses.json").read_text())
    losses = [ckpt_model.step(model, opt, i) for i in (3, 4)]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses, expect)), (losses, expect)
