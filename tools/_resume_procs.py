"""Starting the jobs of the resume tools (tools/resume_faults.py, tools/resume_layouts.py): a worker
script as P processes (torchrun, P > 1) of D CPU devices each, in a session of its own so that a
timeout or a fault kills the whole job."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port():
    """A port free together with the next one (torchrun's store listens on the first, torchacc's
    JAX coordinator on the second)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def command(procs, script_args, restarts=0):
    """``python script ...`` for one process, else under ``torch.distributed.run``."""
    if procs == 1 and restarts == 0:
        return [sys.executable, *script_args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={procs}",
        f"--max-restarts={restarts}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *script_args,
    ]


def environment(devices=None, **extra):
    """The jobs' environment: CPU JAX, this tree first on the path, ``devices`` CPU devices per
    process (None: torchacc's default single device), no launcher variables inherited."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in _LAUNCH_ENV:
        env.pop(k, None)
    if devices is not None:
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    env.update(extra)
    return env


def start(cmd, env, out_path=None):
    """Start ``cmd`` in a new session; its output goes to ``out_path`` (a pipe nobody reads
    could block it) or, without one, to a pipe for :func:`finish`."""
    out = open(out_path, "w") if out_path else subprocess.PIPE
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    if out_path:
        out.close()
        proc.output = lambda: open(out_path).read()
    return proc


def finish(proc, timeout):
    """Wait for a started job: (return code, output); past ``timeout`` its whole session is
    killed and the code is 124."""
    try:
        if getattr(proc, "output", None) is None:
            out, _ = proc.communicate(timeout=timeout)
        else:
            proc.wait(timeout=timeout)
            out = proc.output()
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        if getattr(proc, "output", None) is None:
            out, _ = proc.communicate()
        else:
            proc.wait()
            out = proc.output()
        return 124, out
