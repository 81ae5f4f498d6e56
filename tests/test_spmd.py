"""SPMD sharding through XLA's partitioner on 4 CPU devices.

The cases live in tests/spmd_cases/ and run in a fresh process: the device count
(``CPU_NUM_DEVICES=4``, torch_xla's variable) must be set before JAX starts, and SPMD mode is
for the whole process.
"""

import os

import pytest
from spmd_launch import launch_gpt_tiny, run_cases, torchrun_case


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_sharding")
def test_sharding_cases_on_4_devices():
    out = run_cases("case_sharding.py")
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_accelerate")
def test_accelerate_fsdp_and_tp_cases_on_4_devices():
    out = run_cases("case_accelerate.py")
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.devices(2)
def test_two_processes_of_two_devices_form_one_mesh_of_four(tmp_path):
    """torchrun, 2 processes x 2 CPU devices: one global mesh with the same results as eager
    (and so as 1 process x 4 devices), for 2-D sharding and FSDPv2 on a HybridMesh."""
    import json

    out = tmp_path / "r"
    proc = torchrun_case("mp_worker.py", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"r.{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert (r["devices"], r["local"], r["process_count"]) == (4, 2, 2)
        assert r["hybrid_ids"] == [0, 1, 2, 3]
        for case in ("two_d", "fsdp"):
            assert r[case]["param_err"] <= 1e-5, (case, r[case])
            assert all(abs(a - b) <= 1e-5 for a, b in r[case]["losses"]), r[case]["losses"]
            assert r[case]["graphs"][2:] == [0] * 3, r[case]["graphs"]
        assert r["two_d"]["spec"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert results[0]["two_d"] == results[1]["two_d"]


@pytest.mark.slow
def test_launcher_fsdp_compiler_path_matches_eager(tmp_path):
    """--compiler-opt --fsdp --mesh 2,2 on 4 CPU devices trains gpt-tiny with the losses of the
    eager single-process run on the same batches; bad flags are one-line errors (exit 2)."""
    ckpt = tmp_path / "ckpt"
    proc, sharded = launch_gpt_tiny(
        tmp_path,
        "fsdp",
        "--compiler-opt",
        "--fsdp",
        "--mesh=2,2",
        f"--save_dir={ckpt}",
        "--save_interval=2",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=4,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "fsdp: mesh data=2 x fsdp=2; parameter bytes per device" in log
    assert "fsdp: bytes per device after step 2: parameters" in log and "optimizer state" in log
    proc, eager = launch_gpt_tiny(tmp_path, "eager")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(sharded["losses"]) == 4
    for a, b in zip(sharded["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5, (sharded["losses"], eager["losses"])
    # each save is a DCP checkpoint (torch_xla's CheckpointManager layout); resuming on another
    # mesh reshards it and continues with the uninterrupted run's losses
    assert sorted(os.listdir(ckpt)) == ["2", "4"] and any(
        f.endswith(".distcp") for f in os.listdir(ckpt / "2")
    )
    import shutil

    shutil.rmtree(ckpt / "4")
    proc, resumed = launch_gpt_tiny(
        tmp_path,
        "resumed",
        "--compiler-opt",
        "--fsdp",
        "--mesh=1,4",
        f"--resume={ckpt}",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=4,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert resumed["steps"] == [2, 3]
    # the checkpoint holds the loader's position (issue 42): the resume continues at the next
    # sample of the saved run's global order, and a run on other data is refused by name
    assert "resumed from step 2: epoch 0, batch 2 (16 samples of the epoch consumed" in (
        proc.stdout + proc.stderr
    )
    proc, _ = launch_gpt_tiny(
        tmp_path, "other_data", "--compiler-opt", "--fsdp", f"--resume={ckpt}", "--seed=7"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: --resume {ckpt / '2'}: EpochBatches state is for another dataset: its seed" in (
        proc.stderr
    ), proc.stderr[-3000:]
    for a, b in zip(resumed["losses"], sharded["losses"][2:]):
        assert abs(a - b) <= 1e-5, (resumed["losses"], sharded["losses"])
    for flags, message in (
        (("--mesh=2,2",), "--mesh is for --fsdp --compiler-opt"),
        (("--fsdp", "--model=resnet-tiny"), "--fsdp shards the gpt and llama models"),
        (("--fsdp", "--compiler-opt", "--mesh=2"), "expected DATA,FSDP"),
    ):
        proc, _ = launch_gpt_tiny(tmp_path, "bad", *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr[-2000:])
