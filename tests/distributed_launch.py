"""Launching tests/distributed_worker.py as a 2-process job (shared by tests/test_distributed_*)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "distributed_worker.py")


def free_port():
    """A port P with P and P+1 free: torchrun's store takes P, the JAX coordinator P+1."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    e["JAX_PLATFORMS"] = "cpu"
    e["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def torchrun(scenario, out, *args, nproc=2, timeout=240):
    """Run the worker under ``python -m torch.distributed.run``; returns the CompletedProcess."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        WORKER,
        scenario,
        str(out),
        *map(str, args),
    ]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def single(scenario, out, *args, timeout=240):
    """Run the worker as one plain process (no launcher environment: world size 1)."""
    cmd = [sys.executable, WORKER, scenario, str(out), *map(str, args)]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def spawn(scenario, out, *args, nproc=2, **extra_env):
    """Start ``nproc`` worker processes with torchrun's variables but no torchrun agent (which
    would itself tear the job down when a worker fails); returns the Popen objects. Rank r's
    stdout and stderr go to ``OUT/rank<r>.log`` (see ``log``)."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        e = env(
            RANK=rank,
            LOCAL_RANK=rank,
            WORLD_SIZE=nproc,
            LOCAL_WORLD_SIZE=nproc,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **extra_env,
        )
        cmd = [sys.executable, WORKER, scenario, str(out), *map(str, args)]
        with open(os.path.join(out, f"rank{rank}.log"), "w") as f:
            procs.append(subprocess.Popen(cmd, env=e, stdout=f, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def log(out, rank, last=40):
    """The last lines of rank ``rank``'s output from ``spawn`` (Gloo chatter and C++ stack
    frames left out)."""
    with open(os.path.join(out, f"rank{rank}.log"), errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if not ln.startswith(("[Gloo]", "    @"))]
    return "\n".join(lines[-last:])


def report(proc):
    """The tail of a finished run's output, for assertion messages."""
    text = (proc.stdout or "") + "\n" + (proc.stderr or "")
    lines = [ln for ln in text.splitlines() if not ln.startswith("[Gloo]")]
    return "\n".join(lines[-60:])


def load(out, name, rank):
    with open(os.path.join(out, f"{name}-{rank}.json")) as f:
        return json.load(f)
