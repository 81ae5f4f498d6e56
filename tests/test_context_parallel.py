"""torchacc.ops.context_parallel (Ulysses, ring attention, split/gather) on 4 CPU devices.

The cases live in tests/spmd_cases/case_context_parallel.py and run in a fresh process: the
device count must be set before JAX starts, and SPMD mode is for the whole process.
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.xdist_group("spmd_context_parallel")
def test_context_parallel_cases_on_4_devices():
    out = run_cases("case_context_parallel.py")
    assert " passed" in out and "failed" not in out


@pytest.mark.devices(2)
def test_per_process_ulysses_and_ring_under_torchrun(tmp_path):
    """TorchAcc's style: torchrun, 2 processes x 1 device, each holding its sequence chunk;
    Ulysses and ring output and dq/dk/dv (through split/gather) equal eager attention, causal,
    not, and varlen."""
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
