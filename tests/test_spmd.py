"""SPMD sharding through XLA's partitioner on 4 CPU devices.

The cases live in tests/spmd_cases/ and run in a fresh process: the device count
(``CPU_NUM_DEVICES=4``, torch_xla's variable) must be set before JAX starts, and SPMD mode is
for the whole process.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_cases(name, devices=4, timeout=600):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-q",
            "-p",
            "no:cacheprovider",
            os.path.join(HERE, "spmd_cases", name),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout


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

    from distributed_launch import env, free_port

    out = tmp_path / "r"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        os.path.join(HERE, "spmd_cases", "mp_worker.py"),
        str(out),
    ]
    proc = subprocess.run(
        cmd,
        env=env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=2),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=os.path.dirname(HERE),
    )
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


def _launch(tmp_path, name, *flags, **env_extra):
    import json

    from distributed_launch import env

    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "launch_single_task.py",
            "--nproc_per_node=1",
            "--model=gpt-tiny",
            "--batch_size=8",
            "--max_steps=4",
            "--amp_level=O0",
            f"--output={out}",
            *flags,
        ],
        env=env(TORCHACC_CACHE_DIR="off", **env_extra),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(HERE),
    )
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


@pytest.mark.slow
def test_launcher_fsdp_compiler_path_matches_eager(tmp_path):
    """--compiler-opt --fsdp --mesh 2,2 on 4 CPU devices trains gpt-tiny with the losses of the
    eager single-process run on the same batches; bad flags are one-line errors (exit 2)."""
    ckpt = tmp_path / "ckpt"
    proc, sharded = _launch(
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
    proc, eager = _launch(tmp_path, "eager")
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
    proc, resumed = _launch(
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
    for a, b in zip(resumed["losses"], sharded["losses"][2:]):
        assert abs(a - b) <= 1e-5, (resumed["losses"], sharded["losses"])
    for flags, message in (
        (("--mesh=2,2",), "--mesh is for --fsdp --compiler-opt"),
        (("--fsdp", "--model=resnet-tiny"), "--fsdp shards the gpt and llama models"),
        (("--fsdp", "--compiler-opt", "--mesh=2"), "expected DATA,FSDP"),
    ):
        proc, _ = _launch(tmp_path, "bad", *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr[-2000:])
