"""Megatron tensor parallelism (``Config.dist.tp``, torch's ``parallelize_module`` plans) on 4
CPU devices: the cases live in tests/spmd_cases/case_tensor_parallel.py and run in a fresh
process (the device count must be set before JAX starts; SPMD mode is for the whole process)."""

import re

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
    log shows the 4-axis mesh and each device's parameter bytes. So does ``--pp 2 --tp 2`` on 4
    CPU devices: gpt-tiny's two blocks as two uniform pipeline stages, Megatron pairs split
    over tp inside each (1F1B, 2 micro-batches), the log naming the mesh, the split point and
    each device's parameter bytes (one stage's tp slice: <= 1/(pp x tp) + 10%)."""
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
    proc, piped = launch_gpt_tiny(
        tmp_path,
        "pp",
        "--compiler-opt",
        "--fsdp",
        "--pp=2",
        "--tp=2",
        "--max_steps=2",
        "--seq_len=16",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=4,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    line = next((x for x in log.splitlines() if "pp: mesh dp=1 x fsdp=1 x pp=2 x tp=2;" in x), None)
    assert line is not None, log[-4000:]
    assert "stages cut before model.h.1; 2 micro-batches (1f1b)" in line, line
    found = re.findall(r"per device ([\d,]+) \(unsharded ([\d,]+)\)", line)
    per_device, unsharded = (int(v.replace(",", "")) for v in found[0])
    assert per_device <= unsharded / 4 * 1.1, line  # one stage's tp slice; the rest on pp x tp
    proc, eager = launch_gpt_tiny(tmp_path, "eager", "--max_steps=2", "--seq_len=16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for run in (sharded, piped):
        assert len(run["losses"]) == 2
        for a, b in zip(run["losses"], eager["losses"]):
            assert abs(a - b) <= 1e-5, (run["losses"], eager["losses"])
