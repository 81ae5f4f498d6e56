"""Python children of the tests, forked from a process that has already imported torch and JAX.

Note [Pre-warmed test processes]
Many tests run Python in a fresh process: each docs page (tests/docs_blocks.py) and each SPMD
case file under its own pytest with N CPU devices (tests/spmd_launch.py). Importing torch
(with torch.distributed.tensor, which torchacc's tensors pull in) and JAX is ~2.7 CPU-s of
each such process, the same every time; on the 2-core CI box that was ~100 CPU-s of the suite.
So each xdist worker keeps one server process that imported them once, and forks a child per
run. The child is what a fresh ``python script`` / ``python -m module`` would be, except for
those modules already being in ``sys.modules``:

- it gets the run's environment, working directory, argv, stdin from /dev/null and its own
  session (so a timeout kills it and everything it started, by process group);
- torchacc is NOT pre-imported: it reads its environment (CPU_NUM_DEVICES, TORCHACC_*) at
  import, in the child. XLA reads XLA_FLAGS when the child creates its backend, so each run's
  device count holds (the server never starts a JAX backend). The child's PYTHONPATH entries
  go first on its ``sys.path``;
- a run whose environment differs from the server's in a variable that torch or JAX read at
  import (``JAX_*``, ``TORCH_*``, ``OMP_*``, ...; ``_import_env``) gets a plain fresh process
  instead, and so does a command line with other interpreter options (``-W``, ``-u``);
- at exit the child runs its ``atexit`` functions and flushes, then leaves with ``os._exit``.

Used only where a fresh interpreter is not what the test is about: launcher and torchrun jobs
(process trees, signals, rendezvous) always start real processes. TORCHACC_TEST_PREWARMED=0 runs
everything fresh.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

# read while torch / JAX / numpy import (TORCHACC_* is read by torchacc, in the child)
_IMPORT_PREFIXES = (
    "JAX_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "PYTORCH_",
    "XLA_PYTHON_",
    "TF_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "LD_",
)
# (PYTHONPATH is not one: the child puts its own entries first on sys.path)
_IMPORT_NAMES = ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH")
_PRELOAD = ("torch", "torch.distributed.tensor", "jax", "jax.numpy", "numpy", "pytest")
_servers: dict = {}


def _import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_PREFIXES) or k in _IMPORT_NAMES}


def enabled() -> bool:
    return os.environ.get("TORCHACC_TEST_PREWARMED", "1") != "0" and hasattr(os, "fork")


def _start(env: dict):
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        bufsize=0,  # raw pipes: select() below sees every byte the server wrote
        start_new_session=True,
    )
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise RuntimeError("tests/prewarmed.py: the server did not start")
    return proc


MAX_SERVERS = 3  # one per import environment seen (docs, case files, launcher-style OMP=1)


def _stop() -> None:
    """Close the servers' requests (they exit) and reap them (their CPU counts as this
    process's)."""
    for proc in _servers.values():
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    _servers.clear()


def _server_for(env: dict):
    key = tuple(sorted(_import_env(env).items()))
    proc = _servers.get(key)
    if proc is not None and proc.poll() is not None:
        del _servers[key]  # it died: start another
        proc = None
    if proc is None:
        if len(_servers) >= MAX_SERVERS:
            return None
        if not _servers:
            atexit.register(_stop)
        proc = _servers[key] = _start(env)
    return proc


def run(
    argv: list[str], env: dict | None = None, cwd: str | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``python *argv`` (a script path, ``-m module`` or ``-c code``, then its arguments) with
    ``env`` (default: this process's) in ``cwd``; stdout/stderr captured as text, like
    ``subprocess.run(..., capture_output=True, text=True)``. On timeout the run's whole session
    is killed and ``subprocess.TimeoutExpired`` raised. Interpreter options other than ``-m`` /
    ``-c`` (``-W``, ``-u``, ...) run in a fresh process."""
    env = dict(os.environ) if env is None else env
    cwd = os.getcwd() if cwd is None else str(cwd)
    cmd = [sys.executable, *argv]
    forkable = argv[0] in ("-m", "-c") or not argv[0].startswith("-")
    server = _server_for(env) if enabled() and forkable else None
    if server is None:
        return fresh(cmd, env, cwd, timeout)
    fd, out_path = tempfile.mkstemp(prefix="prewarmed-", suffix=".out")
    os.close(fd)
    err_path = out_path[: -len(".out")] + ".err"
    request = {"argv": argv, "env": env, "cwd": cwd, "out": out_path, "err": err_path}
    server.stdin.write((json.dumps(request) + "\n").encode())
    pid = int(server.stdout.readline())
    ready, _, _ = select.select([server.stdout], [], [], timeout)
    timed_out = not ready
    if timed_out:  # the run's whole session: the child and anything it started
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    code = int(server.stdout.readline())  # the server reaps the child
    out, err = _read_and_remove(out_path), _read_and_remove(err_path)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, code, out, err)


def fresh(cmd, env, cwd, timeout):
    """``cmd`` (any program) in a session of its own, output captured as text; on timeout its
    whole process group is killed and ``subprocess.TimeoutExpired`` raised."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _read_and_remove(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
    finally:
        if os.path.exists(path):
            os.remove(path)


# ----------------------------------------------------------------------------- the server
def _serve() -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    replies = sys.stdout
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        replies.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        print(pid, file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(code, file=replies, flush=True)


def _child(request: dict) -> None:
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = _main(request["argv"])
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _main(argv: list[str]) -> int:
    import runpy

    sys.orig_argv = [sys.executable, *argv]  # what a fresh interpreter would have been given
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [os.path.abspath(p) for p in paths]  # as a fresh interpreter orders them

    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(path)
        runpy.run_path(path, run_name="__main__")
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
