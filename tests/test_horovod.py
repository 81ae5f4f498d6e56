"""torchacc.horovod: one 2-process job (tests/hvd_worker.py checks every collective on both paths,
DistributedOptimizer training against a 1-process run, broadcasts, SyncBatchNorm), started with
Open MPI's environment; and the single-process behaviour (a world of 1, errors before init)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from distributed_launch import REPO, env, free_port

from torchacc import mpi_env
from torchacc.horovod import run as hvd_run

WORKER = os.path.join(REPO, "tests", "hvd_worker.py")


def _mpi_vars(rank, size=2):
    return {
        "OMPI_COMM_WORLD_RANK": rank,
        "OMPI_COMM_WORLD_SIZE": size,
        "OMPI_COMM_WORLD_LOCAL_RANK": rank,
        "OMPI_COMM_WORLD_LOCAL_SIZE": size,
    }


@pytest.mark.timeout(300)
def test_two_ranks_started_like_mpirun(tmp_path):
    """What ``mpirun -np 2 python hvd_worker.py`` gives each rank: only Open MPI's variables (the
    port is passed so that parallel test runs cannot collide)."""
    port = free_port()
    procs = []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w")
        e = env(MASTER_PORT=port, **_mpi_vars(rank))
        cmd = [sys.executable, WORKER, str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace")[-4000:] for r in range(2)]
    assert codes == [0, 0], "\n\n".join(logs)
    checks = [json.loads((tmp_path / f"hvd-{r}.json").read_text()) for r in range(2)]
    assert checks[0] == checks[1]
    for must in (
        "device allreduce Average",
        "cpu alltoall with splits",
        "device reducescatter uneven (3 rows)",
        "shape mismatch error",
        "broadcast_parameters after rank-0 load",
        "broadcast_optimizer_state buffers + lr",
        "SyncBatchNorm device running_var",
        "train cpu backward_passes_per_step=2 param 3",
        "train cpu Compression.fp16 param 3",
        "train device: one program, no compile, no device read",
        "train device backward_passes_per_step=2 param 3",
    ):
        assert must in checks[0], must


def test_mpich_and_openmpi5_jobs_get_their_own_port():
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    a = mpi_env.mpi_environment(pmi, ppid=4242)
    assert a["RANK"] == "1" and a["WORLD_SIZE"] == "2" and a["LOCAL_WORLD_SIZE"] == "2"
    # every rank of a job (same hydra proxy) agrees; another job (another proxy) differs
    assert (
        mpi_env.mpi_environment({**pmi, "PMI_RANK": "0"}, ppid=4242)["MASTER_PORT"]
        == (a["MASTER_PORT"])
    )
    assert mpi_env.mpi_environment(pmi, ppid=4343)["MASTER_PORT"] != a["MASTER_PORT"]
    ompi5 = {k: str(v) for k, v in _mpi_vars(0).items()}
    p1 = mpi_env.mpi_environment({**ompi5, "PMIX_NAMESPACE": "prterun-host-111@1"})
    p2 = mpi_env.mpi_environment({**ompi5, "PMIX_NAMESPACE": "prterun-host-222@1"})
    assert p1["MASTER_PORT"] != p2["MASTER_PORT"]
    assert 20000 <= int(p1["MASTER_PORT"]) < 40000


def test_single_process_is_a_world_of_one():
    code = """
import torch, torchacc.horovod as hvd
try:
    hvd.size()
except ValueError as e:
    assert "hvd.init()" in str(e), e
else:
    raise AssertionError("no error before init")
import torchacc.distributed as dist
assert dist.use_torchacc is False
dist.init_process_group("nccl", world_size=1, rank=0)  # no launcher: a world of one on gloo
t = torch.ones(2)
dist.all_reduce(t)
assert dist.get_world_size() == 1 and t.tolist() == [1.0, 1.0]
hvd.init()  # adopts that group
assert (hvd.size(), hvd.rank(), hvd.local_rank(), hvd.local_size()) == (1, 0, 0, 1)
x = torch.arange(4.0)
assert torch.equal(hvd.allreduce(x), x) and torch.equal(hvd.allgather(x), x)
assert hvd.broadcast_object("a", 0) == "a" and hvd.allgather_object(3) == [3]
m = torch.nn.Linear(2, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0))
m(torch.ones(1, 2)).sum().backward()
opt.step()
hvd.shutdown()
assert not hvd.is_initialized()
print("ok")
"""
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


MINI = os.path.join(REPO, "tests", "hvd_mini.py")


def _minis(tmp_path):
    return [json.loads((tmp_path / f"mini-{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(200)
def test_torchaccrun_stops_the_ranks_when_one_fails(tmp_path):
    """(A successful torchaccrun job: tests/test_gallery_horovod.py.)"""
    run = [sys.executable, "-m", "torchacc.horovod.run", "-np", "2", "-H", "localhost:2"]
    # rank 1 fails: rank 0 (waiting in hvd.init) is stopped, the launcher exits 3 with one line
    start = time.monotonic()
    p = subprocess.run(
        [*run, sys.executable, MINI, str(tmp_path), "1"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
    )
    assert p.returncode == 3, p.stderr[-3000:]
    assert "torchaccrun: rank 1 exited with code 3; stopping the other 1 running" in p.stderr
    assert time.monotonic() - start < 50
    with pytest.raises(SystemExit, match="one node only"):
        hvd_run.main(["-np", "2", "-H", "otherhost:2", "true"])
    with pytest.raises(SystemExit, match="more than the 1 slot"):
        hvd_run.main(["-np", "2", "-H", "localhost:1", "true"])


@pytest.mark.timeout(200)
def test_real_mpirun_through_a_shell_gets_one_job_port(tmp_path):
    """``mpirun -np 2 sh train.sh``, as the seed does: MPICH sets no job id, and each rank's
    parent is its own shell; the ranks still agree on the port (the hydra proxy's pid)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun on PATH (pip install mpich, part of the [test] extra)")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    if "HYDRA" not in version.stdout:
        pytest.skip(f"mpirun is not MPICH's hydra: {version.stdout.splitlines()[:1]}")
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {MINI} {tmp_path}\n")
    e = env()
    e.pop("MASTER_PORT", None)
    p = subprocess.run(
        [mpirun, "-np", "2", "sh", str(script)],
        env=e,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    a, b = _minis(tmp_path)
    assert (a["rank"], b["rank"], a["size"], a["local_rank"], b["local_rank"]) == (0, 1, 2, 0, 1)
    assert a["port"] == b["port"] and 20000 <= int(a["port"]) < 40000
