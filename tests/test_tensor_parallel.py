"""Megatron tensor parallelism (``Config.dist.tp``, torch's ``parallelize_module`` plans) on 4
CPU devices: the cases live in tests/spmd_cases/case_tensor_parallel.py and run in a fresh
process (the device count must be set before JAX starts; SPMD mode is for the whole process)."""

import pytest
from spmd_launch import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_tensor_parallel")
def test_tensor_parallel_cases_on_4_devices():
    out = run_cases("case_tensor_parallel.py")
    assert " passed" in out and "failed" not in out and "skipped" not in out


@pytest.mark.slow
def test_launcher_tp_x_cp_matches_eager(tmp_path):
    """``--compiler-opt --fsdp --tp 2 --cp 2`` on 4 CPU devices: gpt-tiny (2 heads, so the cp
    region is the causal zig-zag ring) trains with the eager single-process run's losses; the
    log shows the 4-axis mesh and each device's parameter bytes."""
    from spmd_launch import launch_gpt_tiny

    proc, sharded = launch_gpt_tiny(
        tmp_path,
        "tp_cp",
        "--compiler-opt",
        "--fsdp",
        "--tp=2",
        "--cp=2",
        "--max_steps=2",
        "--seq_len=16",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=4,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "fsdp: mesh data=1 x fsdp=1 x tp=2 x cp=2; parameter bytes per device" in log, log
    proc, eager = launch_gpt_tiny(tmp_path, "eager", "--max_steps=2", "--seq_len=16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(sharded["losses"]) == 2
    for a, b in zip(sharded["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5, (sharded["losses"], eager["losses"])
