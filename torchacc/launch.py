"""Launcher behind ``launch_single_task.py``: one command for the eager baseline and torchacc.

::

    python launch_single_task.py --nproc_per_node=1 --amp_level=O1 --batch_size=128  # baseline
    python launch_single_task.py --nproc_per_node=8 --amp_level=O1 --compiler-opt --batch_size=128

The launcher parses and validates the flags (a bad flag is an argparse usage error, exit code 2),
then starts ``--nproc_per_node`` workers per node with ``torch.distributed.run`` (torchrun's
engine: static rendezvous on ``--master_addr:--master_port``; on a single node a free port is
picked when none is given so that concurrent runs do not collide). Each worker runs
``python -m gallery.<model>.main`` with the training flags, which parses them again with the same
parser (:func:`parse_args`).

Processes that are already workers run the training in-process instead of spawning:

* started by ``mpirun`` (Open MPI ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``, or
  MPICH / Intel MPI ``PMI_RANK/PMI_SIZE`` + ``MPI_LOCALRANKID/MPI_LOCALNRANKS``) with the default
  ``--nproc_per_node=1``: these are mapped to ``RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE``;
* started by ``torchrun`` or another launcher that already set ``RANK`` and ``WORLD_SIZE``.

With ``mpirun`` starting one launcher per node and ``--nproc_per_node=N``, MPI ranks are taken as
node ranks (``--nnodes``/``--node_rank``) and each launcher spawns its N workers with torchrun.

Before anything starts the launcher checks what would otherwise fail late (one line, exit code 2
each): ``--nproc_per_node`` above this node's devices, unusable path flags, a ``--resume``
checkpoint that is not one (or is unsafe, or is for another model), and ``--compiler-opt`` on a GPU
machine whose JAX has no CUDA backend. Workers die with the launcher, and SIGINT/SIGTERM stop the
job cleanly (Note [Worker lifetime] in ``torchacc/launch_checks.py``); exit codes: 0 done, 1 the
run failed, 2 a usage or set-up error, 130/143 interrupted by SIGINT/SIGTERM.

This module imports nothing heavy at import time, so usage errors come back fast.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
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

# --model name -> worker module. GPT names are the configurations in gallery/gpt/model.py.
MODELS: dict[str, str] = {
    "resnet50": "gallery.resnet50.main",
    "gpt2": "gallery.gpt.main",
    "gpt2-medium": "gallery.gpt.main",
    "gpt2-large": "gallery.gpt.main",
    "gpt-mini": "gallery.gpt.main",
    "gpt-tiny": "gallery.gpt.main",
}

# Flags that only the launcher reads; everything else is forwarded to the workers.
LAUNCH_ONLY = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "oversubscribe",
)


def _load_checks():
    """``torchacc/launch_checks.py``, loaded from its file (no ``torchacc`` package import)."""
    name = "torchacc.launch_checks"
    mod = sys.modules.get(name)
    if mod is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_checks.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


checks = _load_checks()


# ----------------------------------------------------------------------------- value types
def _int_at_least(lo: int, what: str):
    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{what}: must be >= {lo}, got {value}")
        return value

    conv.__name__ = what
    return conv


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _nproc(text: str) -> int | str:
    if text in ("auto", "gpu", "cpu"):
        return text
    return _int_at_least(1, "nproc_per_node")(text)


def _port(text: str) -> int:
    value = _int_at_least(1, "master_port")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"master_port: must be <= 65535, got {value}")
    return value


def _data(text: str) -> str:
    if text == "mock":
        return text
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither 'mock' nor an existing directory (an ImageFolder tree: "
            "DIR/<class>/<image> or DIR/train/<class>/<image>)"
        )
    return os.path.abspath(text)


def _existing_path(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"checkpoint {text!r} does not exist")
    return os.path.abspath(text)


# ----------------------------------------------------------------------------- parser
class _HelpFormatter(argparse.HelpFormatter):
    """Show a flag's default unless its help already says it (or there is none worth saying)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" not in text
            and action.option_strings
            and action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_single_task.py",
        description=(
            "Train a gallery model as eager PyTorch (DDP + AMP; the baseline) or, with "
            "--compiler-opt, through torchacc's lazy XLA device. Workers are started with "
            "torch.distributed.run, or run in place under mpirun/torchrun."
        ),
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("processes (torchrun semantics)")
    g.add_argument(
        "--nproc_per_node",
        type=_nproc,
        default=1,
        help="worker processes on this node (an int, or 'auto'/'gpu': one per GPU, 'cpu': 1)",
    )
    g.add_argument("--nnodes", type=_int_at_least(1, "nnodes"), default=1, help="number of nodes")
    g.add_argument(
        "--node_rank", type=_int_at_least(0, "node_rank"), default=0, help="rank of this node"
    )
    g.add_argument("--master_addr", default=None, help="rendezvous host (default 127.0.0.1)")
    g.add_argument(
        "--master_port",
        type=_port,
        default=None,
        help="rendezvous port (default: a free port on one node, 29500 on several)",
    )
    g.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more processes than CPU cores on a CPU-only node (GPUs: one process each)",
    )

    g = p.add_argument_group("model and mode")
    g.add_argument("--model", choices=sorted(MODELS), default="resnet50", help="gallery model")
    g.add_argument(
        "--compiler-opt",
        "--compiler_opt",
        dest="compiler_opt",
        action="store_true",
        help="run the training step through torchacc (lazy XLA device); without it: eager DDP",
    )
    g.add_argument(
        "--kernel-opt",
        "--kernel_opt",
        dest="kernel_opt",
        action="store_true",
        help="ask the compiler path for its optimized kernels (sets TORCHACC_KERNEL_OPT=1)",
    )
    g.add_argument(
        "--torch_compile",
        action="store_true",
        help="eager path only: wrap the model in torch.compile (Inductor) for comparison",
    )
    g.add_argument(
        "--amp_level",
        choices=("O0", "O1"),
        default="O1",
        help="O0: float32; O1: autocast (+ GradScaler for fp16)",
    )
    g.add_argument(
        "--amp_dtype",
        choices=("bf16", "fp16"),
        default=None,
        help="autocast dtype for O1 (default: bf16 where the device supports it, else fp16)",
    )

    g = p.add_argument_group("training")
    g.add_argument(
        "--batch_size", type=_int_at_least(1, "batch_size"), default=128, help="per process"
    )
    g.add_argument(
        "--max_steps",
        type=_int_at_least(1, "max_steps"),
        default=None,
        help="total optimizer steps (overrides --epochs)",
    )
    g.add_argument(
        "--epochs", type=_int_at_least(1, "epochs"), default=1, help="passes over the data"
    )
    g.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="AdamW learning rate (default: 1e-3 for resnet50, 6e-4 for the gpt models)",
    )
    g.add_argument(
        "--weight_decay",
        type=_nonneg_float,
        default=None,
        help="AdamW weight decay (default: 1e-4 for resnet50, 0.1 for the gpt models)",
    )
    g.add_argument(
        "--image_size", type=_int_at_least(16, "image_size"), default=224, help="resnet50 only"
    )
    g.add_argument(
        "--seq_len",
        type=_int_at_least(2, "seq_len"),
        default=None,
        help="gpt: tokens per sample (default: the model's block size, 1024 for gpt2)",
    )
    g.add_argument(
        "--data",
        type=_data,
        default="mock",
        help="'mock' (in-memory synthetic data) or, for resnet50, an ImageFolder directory",
    )
    g.add_argument(
        "--mock_samples",
        type=_int_at_least(1, "mock_samples"),
        default=None,
        help="mock dataset size (default: 1,281,167 images like ImageNet-1k train; gpt: 2**20)",
    )
    g.add_argument(
        "--workers",
        type=_int_at_least(0, "workers"),
        default=None,
        help="DataLoader workers per process for ImageFolder data (default: min(8, cpus/procs))",
    )
    g.add_argument(
        "--seed", type=_int_at_least(0, "seed"), default=42, help="model init, data order, RNG"
    )

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument(
        "--log_interval",
        type=_int_at_least(1, "log_interval"),
        default=10,
        help="steps between progress lines (the loss is read from the device only then)",
    )
    g.add_argument("--output", default=None, help="write metrics as JSON to this file (rank 0)")
    g.add_argument("--save_dir", default=None, help="directory for checkpoints (rank 0 writes)")
    g.add_argument(
        "--save_interval",
        type=_int_at_least(0, "save_interval"),
        default=0,
        help="save every N steps (0: only at the end); needs --save_dir",
    )
    g.add_argument(
        "--resume",
        type=_existing_path,
        default=None,
        help="checkpoint file, or a directory: its latest checkpoint",
    )
    g.add_argument(
        "--warmup_steps",
        type=_int_at_least(0, "warmup_steps"),
        default=None,
        help="steps left out of the steady-state samples/s (default: min(5, steps // 2))",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.save_interval and not args.save_dir:
        parser.error("--save_interval needs --save_dir")
    if args.node_rank >= args.nnodes:
        parser.error(f"--node_rank {args.node_rank} must be < --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.master_addr is None and "MASTER_ADDR" not in os.environ:
        parser.error("--nnodes > 1 needs --master_addr (the address of node 0)")
    if args.model == "resnet50":
        if args.seq_len is not None:
            parser.error("--seq_len applies to the gpt models, not resnet50")
    else:
        if args.data != "mock":
            parser.error(f"--data: {args.model} trains on mock tokens only; use --data mock")
        block = _gpt_block_size(args.model) if args.seq_len is not None else None
        if block is not None and args.seq_len > block:
            parser.error(f"--seq_len {args.seq_len} > {args.model}'s block size {block}")
    if args.torch_compile and args.compiler_opt:
        parser.error(
            "--torch_compile is for the eager path; it cannot be combined with --compiler-opt"
        )
    return args


def _gpt_block_size(model: str) -> int | None:
    try:
        from gallery.gpt.model import CONFIGS
    except ImportError:  # the gallery is not importable from here: the worker checks it
        return None
    cfg = CONFIGS.get(model)
    return None if cfg is None else cfg.block_size


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The training flags (launch-only ones removed), as the workers will parse them."""
    out: list[str] = []
    for action in build_parser()._actions:
        dest = action.dest
        if dest in LAUNCH_ONLY or dest == "help" or not action.option_strings:
            continue
        value = getattr(args, dest, None)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif value is not None:
            out += [flag, str(value)]
    return out


# ----------------------------------------------------------------------------- environment
def repo_root() -> Path:
    """The directory holding ``gallery/`` (the checkout root)."""
    return Path(__file__).resolve().parents[1]


def find_free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


_MPI_VARIANTS = (
    # (rank, size, local rank, local size)
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
_MPI_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE", "PMI_ID")


def mpi_environment(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """torch.distributed variables for a process started by mpirun, or None if not under MPI.

    RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE come from the MPI variables. MASTER_ADDR and
    MASTER_PORT are kept if set; otherwise MASTER_ADDR is 127.0.0.1 (single node only) and
    MASTER_PORT is derived from the MPI job id, so all ranks of one job agree on it without
    talking and two jobs on one machine get different ports.
    """
    env = os.environ if environ is None else environ
    for rank_k, size_k, lrank_k, lsize_k in _MPI_VARIANTS:
        if rank_k in env and size_k in env:
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
                job = next((env[k] for k in _MPI_JOB_IDS if env.get(k)), None)
                if job is None:
                    out["MASTER_PORT"] = "29500"
                else:
                    digest = hashlib.sha1(job.encode()).digest()
                    out["MASTER_PORT"] = str(20000 + int.from_bytes(digest[:4], "big") % 20000)
            return out
    return None


def _already_a_worker(environ) -> bool:
    return "RANK" in environ and "WORLD_SIZE" in environ and "LOCAL_RANK" in environ


def _run_in_process(module: str, argv: list[str]) -> int:
    import importlib

    mod = importlib.import_module(module)
    mod.main(argv)
    return 0


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
    if spawning:
        nproc = _resolve_nproc(args.nproc_per_node)
        err = checks.nproc_error(nproc, args.compiler_opt, args.oversubscribe)
        if err:
            return err
    if args.compiler_opt:
        err = checks.cuda_jax_mismatch(checks.cuda_device_count(), checks.jax_cuda_plugins())
        if err:
            return err
    if args.resume:
        err = _check_resume(args)
        if err:
            return err
    return None


def _check_resume(args: argparse.Namespace) -> str | None:
    """Resolve ``--resume`` to one good checkpoint file (safe load, tensors left on disk) and
    check it is for this model; ``args.resume`` becomes that file so workers need not search."""
    if os.path.isfile(args.resume) and not zipfile.is_zipfile(args.resume):  # no torch needed
        return (
            f"--resume {args.resume}: not a checkpoint (not a torch.save archive; damaged or "
            "another kind of file)"
        )
    from gallery.common.checkpoint import CheckpointError, resolve_checkpoint

    try:
        path, state = resolve_checkpoint(args.resume, warn=_say)
    except CheckpointError as e:
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
    module = MODELS[args.model]

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
    wargs = worker_argv(args)
    nnodes, node_rank = args.nnodes, args.node_rank
    master_addr = args.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if mpi is not None and nproc == 1:
        # mpirun started one process per worker: this process is the worker.
        os.environ.update(mpi)
        if mpi["RANK"] == "0":
            print(
                f"[launch] {args.model}: mpirun, {mpi['WORLD_SIZE']} process(es), this is rank "
                f"{mpi['RANK']} (local {mpi['LOCAL_RANK']}), master "
                f"{mpi['MASTER_ADDR']}:{mpi['MASTER_PORT']}",
                flush=True,
            )
        return _run_in_process(module, wargs)
    if mpi is not None:
        # mpirun started one launcher per node (--nproc_per_node > 1): MPI ranks are nodes.
        nnodes, node_rank = int(mpi["WORLD_SIZE"]), int(mpi["RANK"])
        master_addr, master_port = mpi["MASTER_ADDR"], int(mpi["MASTER_PORT"])
    elif _already_a_worker(os.environ):
        return _run_in_process(module, wargs)
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
        "--module",
        module,
        *wargs,
    ]
    mode = "torchacc (--compiler-opt)" if args.compiler_opt else "eager (DDP)"
    print(
        f"[launch] {args.model}: {mode}, {nnodes} node(s) x {nproc} process(es), "
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
        torchrun(torchrun_parse_args(cmd))
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


if __name__ == "__main__":
    sys.exit(main())
