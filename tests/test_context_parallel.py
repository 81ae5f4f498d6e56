"""torchacc.ops.context_parallel (Ulysses, ring, 2-D, split/gather) against eager attention.

SPMD style: the cases live in tests/spmd_cases/case_context_parallel.py and run in a fresh
process with 4 CPU devices (the device count must be set before JAX starts, and SPMD mode is for
the whole process). Per-process style: tests/spmd_cases/mp_context_parallel_worker.py under
torchrun, 2 processes of one device.
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_context_parallel")
def test_context_parallel_cases_on_4_devices():
    out = run_cases("case_context_parallel.py")
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.devices(2)
def test_per_process_style_under_torchrun(tmp_path):
    """TorchAcc's style: torchrun, 2 processes x 1 device, each holding its sequence chunk;
    Ulysses, ring and 2-D output and dq/dk/dv (through split/gather) equal eager attention,
    causal, not, and varlen."""
    import json

    from spmd_launch import torchrun_case

    out = tmp_path / "r"
    proc = torchrun_case("mp_context_parallel_worker.py", out, devices=1)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"r.{rank}.json").read_text())
        for op in ("ulysses", "ring_attention", "context_parallel_2d"):
            for case in ("full", "causal", "varlen"):
                errs = r[f"{op}-{case}"]
                assert max(errs) <= 1e-5, (rank, op, case, errs)
