"""A process started by ``mpirun``: its rank, world size and local rank, and a per-job rendezvous
port (standard library only; the launcher loads it by file, ``torchacc.horovod`` imports it).

Open MPI sets ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``; MPICH (hydra) and Intel MPI
set ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``. Two jobs on one machine
must not rendezvous on the same port, so the port is derived from the job's identity: Open MPI's
job id (``OMPI_MCA_ess_base_jobid``, 4.x) or PMIx namespace (``PMIX_NAMESPACE``, 5.x). MPICH sets
no job id, but all ranks of a job on one node descend from the same hydra proxy
(``hydra_pmi_proxy``, found up the process tree: ``mpirun sh train.sh`` puts a shell per rank in
between), so its process id names the job there (a multi-node MPICH job needs ``MASTER_ADDR`` and
``MASTER_PORT``).
"""

from __future__ import annotations

import hashlib
import os

VARIANTS = (
    # (rank, size, local rank, local size, job-id variables; None: the ranks' common parent)
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"),
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ("PMIX_NAMESPACE", None)),
)
PORT_BASE, PORT_SPAN = 20000, 20000


def job_port(job: str) -> int:
    """A port in [20000, 40000) that every rank of the job ``job`` computes alike (P and P+1 are
    used: the torch.distributed store and the JAX coordinator)."""
    digest = hashlib.sha1(job.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def mpich_proxy():
    """The pid of the hydra proxy above this process (``mpirun ... sh train.sh`` puts a shell in
    between, one per rank), else the parent's pid."""
    pid = os.getppid()
    for _ in range(8):
        if pid is None or pid <= 1:
            break
        if _comm(pid).startswith("hydra_pmi_prox"):
            return pid
        pid = _parent(pid)
    return os.getppid()


def job_id(environ, keys, ppid=None) -> str | None:
    """The job's identity from ``keys`` (None in ``keys`` stands for the hydra proxy's pid)."""
    for k in keys:
        if k is None:
            return f"ppid:{mpich_proxy() if ppid is None else ppid}"
        if environ.get(k):
            return f"{k}:{environ[k]}"
    return None


def mpi_environment(environ=None, ppid=None) -> dict[str, str] | None:
    """torch.distributed variables for a process started by mpirun, or None if not under MPI.

    RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE come from the MPI variables. MASTER_ADDR and
    MASTER_PORT are kept if set; otherwise MASTER_ADDR is 127.0.0.1 (single node only) and
    MASTER_PORT is derived from the job's identity (see the module docstring), so all ranks of
    one job agree on it without talking and two jobs on one machine get different ports.
    """
    env = os.environ if environ is None else environ
    for rank_k, size_k, lrank_k, lsize_k, job_keys in VARIANTS:
        if rank_k not in env or size_k not in env:
            continue
        rank, size = int(env[rank_k]), int(env[size_k])
        local_rank = int(env.get(lrank_k, rank))
        local_size = int(env.get(lsize_k, size))
        out = {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size),
            "GROUP_RANK": str(rank // max(local_size, 1)),
        }
        if "MASTER_ADDR" not in env and local_size < size:
            raise RuntimeError(
                "mpirun across several nodes: pass --master_addr (or set MASTER_ADDR) to the "
                "address of the node running rank 0"
            )
        out["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" in env:
            out["MASTER_PORT"] = env["MASTER_PORT"]
        else:
            job = job_id(env, job_keys, ppid)
            out["MASTER_PORT"] = "29500" if job is None else str(job_port(job))
        return out
    return None


def adopt(environ=None) -> dict[str, str]:
    """Copy mpirun's variables into torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) when mpirun, not torchrun, started this process; returns what it
    set (nothing when torchrun's variables are there or there is no MPI)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {}
    mpi = mpi_environment(env)
    if mpi is None:
        return {}
    env.update(mpi)
    return mpi


def job_world_size(environ=None) -> int:
    """The number of processes the launcher started (torchrun's or mpirun's variables; 1)."""
    env = os.environ if environ is None else environ
    for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1
