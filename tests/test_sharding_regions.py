"""Manual regions (torch_xla's ``_shard_map`` / ``xs.shard_map``) on 4 CPU devices.

The cases live in tests/spmd_cases/case_regions.py and run in a fresh process with 4 CPU devices
(the device count must be set before JAX starts).
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.xdist_group("spmd_regions")
def test_manual_region_cases_on_4_devices():
    out = run_cases("case_regions.py")
    assert "7 passed" in out and "failed" not in out  # every case of the file ran


@pytest.mark.xdist_group("spmd_switch")
def test_switching_to_spmd_after_tensors_exist_on_4_devices():
    out = run_cases("case_switch.py")
    assert "1 passed" in out and "failed" not in out


@pytest.mark.devices(2)
def test_per_process_all_reduce_next_to_sharding_in_one_step(tmp_path):
    """2 processes x 2 devices: FSDP over each process's devices and xm.all_reduce across the
    processes (a manual region over the process axis) in one step, equal to eager on the global
    batch, one program after step 2. Then blocking dist.send/recv between the processes (Note
    [Send and receive in SPMD mode]): each process's own value arrives, replicated or split over
    the receiver's devices; a buffer of another layout is a ValueError on both."""
    import json

    from spmd_launch import torchrun_case

    out = tmp_path / "r"
    proc = torchrun_case("mp_mix_worker.py", out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"r.{rank}.json").read_text())
        assert max(r["errs"]) <= 1e-5, r
        assert r["graphs"][2:] == [0, 0], r
        want = [["replicated", True]]
        if rank == 0:
            want += [["split", True], ["layout", "P('fsdp', None)"]]
        assert r["p2p"] == want + [["other layout", True]], r["p2p"]
