"""Launcher behind ``launch_single_task.py``: one command for the eager baseline and torchacc.

::

    python launch_single_task.py --nproc_per_node=1 --amp_level=O1 --batch_size=128  # baseline
    python launch_single_task.py --nproc_per_node=8 --amp_level=O1 --compiler-opt --batch_size=128

The launcher parses and validates the flags (a bad flag is an argparse usage error, exit code 2),
then starts ``--nproc_per_node`` workers per node with ``torch.distributed.run`` (torchrun's
engine: static rendezvous on ``--master_addr:--master_port``; on a single node a free port is
picked when none is given so that concurrent runs do not collide). Each worker runs the
``--model``'s worker from the model registry (``torchacc/launch_registry.py``; the gallery
registers ``python -m gallery.<model>.main``) with the training flags, which it parses again with
the same parser (:func:`parse_args`). ``--model MODULE:FUNCTION`` calls a function of one's own
with those flags instead, and a script path after the launcher's flags runs that script with
the flags that follow it (``python -m torchacc.launch --nproc_per_node 2 train.py --lr 1e-3``).

Processes that are already workers run the training in-process instead of spawning:

* started by ``mpirun`` (Open MPI ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``, or
  MPICH / Intel MPI ``PMI_RANK/PMI_SIZE`` + ``MPI_LOCALRANKID/MPI_LOCALNRANKS``) with the default
  ``--nproc_per_node=1``: these are mapped to ``RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE``;
* started by ``torchrun`` or another launcher that already set ``RANK`` and ``WORLD_SIZE``.

With ``mpirun`` starting one launcher per node and ``--nproc_per_node=N``, MPI ranks are taken as
node ranks (``--nnodes``/``--node_rank``) and each launcher spawns its N workers with torchrun.

Before anything starts the launcher checks what would otherwise fail late (one line, exit code 2
each): ``--nproc_per_node`` above this node's devices, unusable path flags, a ``--resume``
checkpoint that is not one (or is unsafe, or is for another model), a ``--mesh`` that does not
hold the job's devices, ``--tensorboard`` without a
writer package, a ``--profile`` window outside the run, and ``--compiler-opt`` on a GPU machine
whose JAX has no CUDA backend. Workers die with the launcher, and SIGINT/SIGTERM stop the
job cleanly (Note [Worker lifetime] in ``torchacc/launch_checks.py``); exit codes: 0 done, 1 the
run failed, 2 a usage or set-up error, 130/143 interrupted by SIGINT/SIGTERM.

This module imports nothing heavy at import time, so usage errors come back fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = [
    "MODELS",
    "LAUNCH_ONLY",
    "build_parser",
    "parse_args",
    "worker_argv",
    "mpi_environment",
    "find_free_port",
    "repo_root",
    "main",
]


def _load_sibling(module):
    """``torchacc/<module>.py``, loaded from its file: the launcher never imports the
    ``torchacc`` package (JAX) itself, so the eager path stays plain PyTorch."""
    name = f"torchacc.{module}"
    mod = sys.modules.get(name)
    if mod is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{module}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


checks = _load_sibling("launch_checks")
registry = _load_sibling("launch_registry")  # --model names, filled by the gallery (or others)
_args = _load_sibling("launch_args")
MODELS, LAUNCH_ONLY = _args.MODELS, _args.LAUNCH_ONLY
build_parser, parse_args, worker_argv = _args.build_parser, _args.parse_args, _args.worker_argv


# ----------------------------------------------------------------------------- environment
def repo_root() -> Path:
    """The directory above the ``torchacc`` package: in a checkout, the root holding the gallery
    (put on the workers' path so that its models' registry and workers import)."""
    return Path(__file__).resolve().parents[1]


def find_free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


# mpirun's environment -> torchrun's, with a per-job port (torchacc/mpi_env.py)
mpi_environment = _load_sibling("mpi_env").mpi_environment


def _already_a_worker(environ) -> bool:
    return "RANK" in environ and "WORLD_SIZE" in environ and "LOCAL_RANK" in environ


def _run_in_process(worker: str, argv: list[str]) -> int:
    """This process is the worker: ``worker``'s ``main(argv)`` (a module), its ``FUNCTION(argv)``
    (``MODULE:FUNCTION``), or a script run as ``__main__`` with ``argv``."""
    import importlib
    import runpy

    if worker.endswith(".py"):
        sys.argv = [worker, *argv]
        runpy.run_path(worker, run_name="__main__")
        return 0
    module, _, func = worker.partition(":")
    getattr(importlib.import_module(module), func or "main")(argv)
    return 0


def _worker_command(worker: str, argv: list[str]) -> list[str]:
    """torchrun's program and arguments for ``worker`` (see :func:`_run_in_process`)."""
    if worker.endswith(".py"):
        return [worker, *argv]
    if ":" in worker:  # run by a small script: no ``torchacc`` package import on the eager path
        shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_worker.py")
        return [shim, worker, *argv]
    return ["--module", worker, *argv]


def _resolve_nproc(value) -> int:
    if isinstance(value, int):
        return value
    if value == "cpu":
        return 1
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        n = 0
    return max(n, 1)


_PROG = "launch_single_task.py"


class _Interrupted(Exception):
    """SIGTERM reached the launcher before torchrun took over its signals."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _fail(line: str, code: int = 2) -> int:
    print(f"{_PROG}: error: {line}", file=sys.stderr, flush=True)
    return code


def _say(line: str) -> None:
    print(f"[launch] {line}", file=sys.stderr, flush=True)


def _preflight(args: argparse.Namespace, spawning: bool) -> str | None:
    """Everything that would otherwise fail after workers started: the first problem, or None."""
    errors = checks.path_errors(args)
    if errors:
        return errors[0]
    err = checks.observe_errors(args)
    if err:
        return err
    if spawning:
        nproc = _resolve_nproc(args.nproc_per_node)
        err = checks.nproc_error(nproc, args.compiler_opt, args.oversubscribe)
        if err:
            return err
    if args.compiler_opt:
        err = checks.cuda_jax_mismatch(checks.cuda_device_count(), checks.jax_cuda_plugins())
        if err:
            return err
    err = _mesh_error(args, nproc=_resolve_nproc(args.nproc_per_node))
    if err:
        return err
    if args.resume and getattr(args, "fsdp", False) and args.compiler_opt:
        return _check_sharded_resume(args)
    if args.resume:
        err = _check_resume(args)
        if err:
            return err
    return None


def _mesh_error(args: argparse.Namespace, nproc: int) -> str | None:
    """--fsdp --compiler-opt --mesh DATA,FSDP times --tp x --cp x --pp must hold exactly the
    job's devices (the worker would refuse it only after start-up)."""
    if not (getattr(args, "fsdp", False) and args.compiler_opt and args.mesh):
        return None
    data, shards = (int(x) for x in args.mesh.split(","))
    axes = [(k, getattr(args, k, 1)) for k in ("tp", "cp", "pp")]
    size = data * shards * math.prod(v for _, v in axes)
    n = args.nnodes * checks.compiler_devices(nproc)
    if size != n:
        times = "".join(f" x --{k} {v}" for k, v in axes if v > 1)
        return f"--mesh {data},{shards}{times} holds {size} devices; this job has {n}"
    return None


def _check_sharded_resume(args: argparse.Namespace) -> str | None:
    """--fsdp --compiler-opt resumes from a directory of sharded (DCP) checkpoints, DIR/<step>/
    (torch_xla's CheckpointManager layout); the worker loads and reshards the newest."""
    path = args.resume
    steps = [d for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
    if not steps:
        return (
            f"--resume {path}: no sharded checkpoint here (--fsdp --compiler-opt saves "
            "DIR/<step>/ directories with --save_dir DIR)"
        )
    return None


def _check_resume(args: argparse.Namespace) -> str | None:
    """Resolve ``--resume`` to one good checkpoint file (safe load, tensors left on disk) and
    check it is for this model; ``args.resume`` becomes that file so workers need not search."""
    if os.path.isfile(args.resume) and not zipfile.is_zipfile(args.resume):  # no torch needed
        return (
            f"--resume {args.resume}: not a checkpoint (not a torch.save archive; damaged or "
            "another kind of file)"
        )
    resolve = registry.lookup(args.model).resolve_checkpoint
    if resolve is None:  # the model's own trainer checks its checkpoints
        return None
    try:
        path, state = resolve(args.resume, warn=_say)
    except ValueError as e:  # one line naming the file (e.g. the gallery's CheckpointError)
        return f"--resume {e}"
    trained = state.get("model_name") or (state.get("args") or {}).get("model")
    if trained is not None and trained != args.model:
        return f"--resume {path}: checkpoint of model {trained}, but this run trains {args.model}"
    args.resume = os.path.abspath(path)
    return None


def _loopback(addr: str) -> bool:
    return addr in ("127.0.0.1", "localhost", "::1") or addr.startswith("127.")


def _bind_locally(nnodes: int, master_addr: str) -> None:
    """One node: collectives' sockets (gloo, NCCL bootstrap) on the loopback interface only."""
    if nnodes == 1 and _loopback(master_addr) and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _own_store(nnodes: int, node_rank: int, master_addr: str, master_port: int):
    """On the rendezvous node, start torchrun's TCPStore server ourselves on a socket bound to
    ``master_addr`` (loopback on one node) instead of every interface; torchrun's static
    rendezvous asks for a multi-tenant store on the same port and gets this server. Returns the
    store to keep alive, or None (not the master node, or the address is not local)."""
    if node_rank != 0:
        return None
    import datetime

    import torch.distributed as dist

    try:
        info = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError:
        return None
    try:
        store = dist.TCPStore(
            master_addr,
            master_port,
            nnodes,
            True,
            datetime.timedelta(seconds=900),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
        )
    except Exception:
        return None
    return store


def _reported_ranks(run_dir: str) -> dict[int, int]:
    """rank -> exit code of workers that already printed why they stopped (trainer markers)."""
    out = {}
    for name in os.listdir(run_dir):
        if name.startswith("reported-rank"):
            try:
                rank = int(name[len("reported-rank") :])
                with open(os.path.join(run_dir, name)) as f:
                    out[rank] = int(f.read().strip() or "1")
            except (ValueError, OSError):
                continue
    return out


def _sigterm_to_exception(signum, frame):
    raise _Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return _interrupted_before_start(signal.SIGINT)
    except _Interrupted as e:
        return _interrupted_before_start(e.signum)


def _interrupted_before_start(signum: int) -> int:
    _say(f"interrupted ({signal.Signals(signum).name}) during start-up, before any step")
    return 128 + signum


def _main(argv: list[str] | None) -> int:
    signal.signal(signal.SIGTERM, _sigterm_to_exception)
    args = parse_args(argv)
    worker = args.script or registry.lookup(args.model).worker

    root = str(repo_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    pythonpath = os.environ.get("PYTHONPATH", "")
    if root not in pythonpath.split(os.pathsep):
        os.environ["PYTHONPATH"] = root + (os.pathsep + pythonpath if pythonpath else "")
    os.environ["TORCHACC_COMPILER_OPT"] = "1" if args.compiler_opt else "0"
    if args.kernel_opt:
        os.environ["TORCHACC_KERNEL_OPT"] = "1"

    if args.master_addr is not None:
        os.environ["MASTER_ADDR"] = args.master_addr
    if args.master_port is not None:
        os.environ["MASTER_PORT"] = str(args.master_port)

    try:
        mpi = mpi_environment()
    except RuntimeError as e:
        return _fail(str(e))
    nproc = _resolve_nproc(args.nproc_per_node)
    in_place = (mpi is not None and nproc == 1) or (mpi is None and _already_a_worker(os.environ))
    problem = _preflight(args, spawning=not in_place)
    if problem:
        return _fail(problem)
    wargs = args.script_args if args.script else worker_argv(args)
    nnodes, node_rank = args.nnodes, args.node_rank
    master_addr = args.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if mpi is not None and nproc == 1:
        # mpirun started one process per worker: this process is the worker.
        os.environ.update(mpi)
        if mpi["RANK"] == "0":
            print(
                f"[launch] {args.script or args.model}: mpirun, {mpi['WORLD_SIZE']} process(es), "
                f"this is rank {mpi['RANK']} (local {mpi['LOCAL_RANK']}), master "
                f"{mpi['MASTER_ADDR']}:{mpi['MASTER_PORT']}",
                flush=True,
            )
        return _run_in_process(worker, wargs)
    if mpi is not None:
        # mpirun started one launcher per node (--nproc_per_node > 1): MPI ranks are nodes.
        nnodes, node_rank = int(mpi["WORLD_SIZE"]), int(mpi["RANK"])
        master_addr, master_port = mpi["MASTER_ADDR"], int(mpi["MASTER_PORT"])
    elif _already_a_worker(os.environ):
        return _run_in_process(worker, wargs)
    elif args.master_port is not None:
        master_port = args.master_port
    elif nnodes == 1:
        master_port = find_free_port()
    else:
        master_port = int(os.environ.get("MASTER_PORT", 29500))

    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun would force 1 thread per worker; share the cores instead.
        os.environ["OMP_NUM_THREADS"] = str(max(1, checks.cpu_count() // nproc))
    _bind_locally(nnodes, master_addr)

    cmd = [
        f"--nproc_per_node={nproc}",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--max-restarts={args.max_restarts}",
        *_worker_command(worker, wargs),
    ]
    mode = "torchacc (--compiler-opt)" if args.compiler_opt else "eager (DDP)"
    if args.script:
        mode = "torchacc (--compiler-opt)" if args.compiler_opt else "eager"
    print(
        f"[launch] {args.script or args.model}: {mode}, {nnodes} node(s) x {nproc} process(es), "
        f"master {master_addr}:{master_port}",
        flush=True,
    )
    run_dir = tempfile.mkdtemp(prefix="torchacc-run-")
    os.environ[checks.LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ[checks.RUN_DIR_ENV] = run_dir
    try:
        store = _own_store(nnodes, node_rank, master_addr, master_port)  # noqa: F841 (kept alive)
        return _run_torchrun(cmd, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_torchrun(cmd: list[str], run_dir: str) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse_args
    from torch.distributed.run import run as torchrun

    # torchrun's own notes on a signal ("Received 2 death signal, shutting down workers") would
    # add lines to the one the workers print; its errors stay.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        try:
            torchrun(torchrun_parse_args(cmd))
        except Exception as e:
            # A signal that lands on the first line of torch's elastic metrics wrapper (``start =
            # time.time()``) leaves its ``finally`` reading an unset ``start``: an
            # UnboundLocalError whose context is the SignalException. It is the signal.
            signalled = _signal_in_chain(e, (SignalException, _Interrupted))
            if signalled is None or signalled is e:
                raise
            raise signalled from None
    except (SignalException, _Interrupted) as e:
        # torchrun forwarded the signal to the workers and waited for them (30 s, then SIGKILL).
        signum = int(getattr(e, "sigval", None) or e.signum)
        if not _reported_ranks(run_dir):
            _say(f"interrupted ({signal.Signals(signum).name}) during start-up, before any step")
        return 128 + signum
    except ChildFailedError as e:
        reported = _reported_ranks(run_dir)
        failed = {rank: f.exitcode for rank, f in e.failures.items()}
        if failed and all(rank in reported for rank in failed):
            return max(reported[rank] for rank in failed)  # the workers said why: no box
        print(f"[launch] training failed:\n{e}", file=sys.stderr)
        return 1
    return 0


def _signal_in_chain(error: BaseException, kinds) -> BaseException | None:
    """The first exception of ``kinds`` in ``error``'s chain (itself, its context or cause)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
