"""The multi-process runtime: joining the job, ranks and world size, fast exit.

See Note [Multi-process programs] in ``torchacc/distributed/__init__.py``.

Environment (torchrun sets the first five):

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: this process in the job; JAX ``process_id`` = RANK and
  its device is local device ``LOCAL_RANK`` (``local_device_ids``).
- ``MASTER_ADDR``, ``MASTER_PORT``: the JAX coordinator (hosted by rank 0) listens on
  ``MASTER_ADDR:MASTER_PORT+1`` (torchrun's store has MASTER_PORT itself).
- ``TORCHACC_COORDINATOR_ADDRESS`` (``host:port``) or ``TORCHACC_COORDINATOR_PORT``: override that.
- The coordinator binds to that same ``host:port`` (loopback on one node, the ``MASTER_ADDR``
  interface on several), not to every interface as JAX would by default;
  ``TORCHACC_COORDINATOR_BIND_ADDRESS`` (``host:port``) overrides it.
- ``TORCHACC_DISTRIBUTED=0``: never join a job automatically (each process stands alone).
- ``TORCHACC_HEARTBEAT_TIMEOUT`` (s, default 20): a rank that stops sending heartbeats (killed,
  machine gone) is declared dead after this long and every other rank is terminated.
- ``TORCHACC_INIT_TIMEOUT`` (s, default 300): how long to wait for all ranks to join.
- ``TORCHACC_SHUTDOWN_TIMEOUT`` (s, default 300): how long a rank that finished waits at exit for
  the others to finish too (JAX's shutdown barrier).
- ``TORCHACC_FAST_EXIT=0``: keep Python's normal exit on an uncaught exception. By default a rank
  that dies of an uncaught exception leaves at once (``os._exit(1)``) instead of waiting in the
  shutdown barrier, so ranks blocked in a collective with it fail within seconds.
"""

from __future__ import annotations

import os
import sys
import threading

import jax

AXIS = "process"  # the job-wide mesh axis that runs along processes


class _State:
    __slots__ = ("initialized", "rank", "world", "local_rank")

    def __init__(self):
        self.initialized = False
        self.rank = 0
        self.world = 1
        self.local_rank = 0


_state = _State()
_lock = threading.RLock()


def env_int(name, default, who="torchacc.distributed"):
    """The environment variable ``name`` as an int (``default`` when unset or empty); a
    ``ValueError`` naming ``who`` and the variable when it is not a whole number."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{who}: {name}={text!r} is not an integer") from None


def env_flag(name, default=True):
    """The on/off environment variable ``name``: off for ``0``, ``off``, ``false`` or ``no`` (any
    case), ``default`` when unset or empty, on otherwise."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    return text not in ("0", "off", "false", "no")


def _auto_enabled():
    return env_flag("TORCHACC_DISTRIBUTED")


def env_world_size():
    """WORLD_SIZE from the environment (1 when unset)."""
    return env_int("WORLD_SIZE", 1)


def maybe_initialize():
    """Join the job the environment describes (WORLD_SIZE > 1), once; else do nothing.

    Called by ``torchacc.runtime.device.platform()`` before JAX starts its backends.
    """
    if _state.initialized or not _auto_enabled() or env_world_size() <= 1:
        return False
    initialize()
    return True


all_local_devices = [False]  # set by sharding.mesh.enable() (SPMD mode)


def wants_all_local_devices():
    """SPMD mode (``xr.use_spmd()`` or ``XLA_USE_SPMD=1``): this process joins the job with all
    its local devices, not just the one of its local rank."""
    if all_local_devices[0]:
        return True
    return os.environ.get("XLA_USE_SPMD", "0").strip().lower() in ("1", "true", "on", "yes")


def _jax_distributed_client():
    from jax._src import distributed

    return distributed.global_state.client


def _backends_started():
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # private API moved: let jax.distributed.initialize complain itself
        return False


def coordinator_address():
    """``host:port`` of the JAX coordinator service for this job (rank 0 hosts it)."""
    explicit = os.environ.get("TORCHACC_COORDINATOR_ADDRESS")
    if explicit:
        return explicit
    addr = os.environ.get("MASTER_ADDR")
    port = env_int("MASTER_PORT", None)
    if not addr or port is None:
        raise RuntimeError(
            f"torchacc.distributed: WORLD_SIZE={env_world_size()} but MASTER_ADDR/MASTER_PORT are "
            "not set; start the job with torchrun (or set TORCHACC_COORDINATOR_ADDRESS=host:port)"
        )
    port = env_int("TORCHACC_COORDINATOR_PORT", port + 1)
    return f"{addr}:{port}"


def initialize(coordinator=None, world_size=None, rank=None, local_rank=None):
    """Join the multi-process JAX runtime (idempotent). Arguments default to the environment.

    With a world size of 1 this only records that the process stands alone.
    """
    with _lock:
        if _state.initialized:
            _check_agrees(world_size, rank)
            return
        if _jax_distributed_client() is not None:  # the user called jax.distributed.initialize
            _set_state(jax.process_index(), jax.process_count(), local_rank)
            _check_agrees(world_size, rank)
            return
        world = env_world_size() if world_size is None else int(world_size)
        if world <= 1:
            _set_state(0, 1, 0)
            return
        if rank is None:
            if "RANK" not in os.environ:
                raise RuntimeError(
                    f"torchacc.distributed: WORLD_SIZE={world} but RANK is not set; start the job "
                    "with torchrun"
                )
            rank = env_int("RANK", 0)
        if local_rank is None:
            local_rank = env_int("LOCAL_RANK", 0)
        if not 0 <= rank < world:
            raise RuntimeError(f"torchacc.distributed: RANK={rank} is not in [0, {world})")
        address = coordinator or coordinator_address()
        if _backends_started():
            raise RuntimeError(
                "torchacc.distributed: JAX was already started in single-process mode before this "
                f"process (rank {rank} of {world}) could join the job; make sure nothing uses JAX "
                "before torchacc (or call torchacc.distributed.initialize() first)"
            )
        if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=world,
                process_id=rank,
                # SPMD mode: every local device joins the global mesh (Note [SPMD mode])
                local_device_ids=_local_device_ids(local_rank),
                coordinator_bind_address=os.environ.get("TORCHACC_COORDINATOR_BIND_ADDRESS")
                or address,
                initialization_timeout=env_int("TORCHACC_INIT_TIMEOUT", 300),
                heartbeat_timeout_seconds=env_int("TORCHACC_HEARTBEAT_TIMEOUT", 20),
                shutdown_timeout_seconds=env_int("TORCHACC_SHUTDOWN_TIMEOUT", 300),
            )
        except Exception as e:
            raise RuntimeError(
                f"torchacc.distributed: rank {rank} of {world} could not join the job through the "
                f"JAX coordinator at {address}: {e}"
            ) from e
        _set_state(rank, world, local_rank)
        _install_fast_exit()


def _local_device_ids(local_rank):
    """The devices this process joins the job with: its local rank's one device; in SPMD mode
    all of the machine's, or with several processes per machine (``LOCAL_WORLD_SIZE`` > 1 under
    torchrun, each loading its own data: Note [Per-process batches] in sharding/data.py) its local
    rank's equal block of the machine's GPUs. CPU processes each have their own devices."""
    if not wants_all_local_devices():
        return [local_rank]
    per_node = env_int("LOCAL_WORLD_SIZE", 1)
    if per_node <= 1:
        return None
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no torch CUDA build: let JAX take what it finds
        gpus = 0
    if gpus == 0:
        return None
    if gpus % per_node:
        raise RuntimeError(
            f"torchacc.distributed: SPMD mode with {per_node} processes per machine "
            f"(LOCAL_WORLD_SIZE) over {gpus} GPUs: the GPUs must split evenly among the processes"
        )
    k = gpus // per_node
    return list(range(local_rank * k, (local_rank + 1) * k))


def _set_state(rank, world, local_rank):
    _state.rank = int(rank)
    _state.world = int(world)
    _state.local_rank = int(local_rank if local_rank is not None else env_int("LOCAL_RANK", 0))
    _state.initialized = True


def _check_agrees(world_size, rank):
    if world_size is not None and int(world_size) != _state.world:
        raise RuntimeError(
            f"torchacc.distributed: asked for world size {world_size}, but this process already "
            f"joined a job of {_state.world}"
        )
    if rank is not None and int(rank) != _state.rank:
        raise RuntimeError(
            f"torchacc.distributed: asked for rank {rank}, but this process already joined the "
            f"job as rank {_state.rank}"
        )


def _ensure():
    if not _state.initialized:
        if not maybe_initialize():
            with _lock:
                if not _state.initialized:
                    _set_state(0, 1, 0)


def spans_processes():
    """Whether this process is one of several in a job."""
    return _state.initialized and _state.world > 1


def is_initialized():
    """True once this process joined a job (or settled on running alone)."""
    return _state.initialized


def world_size():
    """Number of processes in the job (joins it first if the environment describes one)."""
    _ensure()
    return _state.world


def rank():
    """This process's rank in the job."""
    _ensure()
    return _state.rank


def local_rank():
    """This process's rank on its machine (= its device index there)."""
    _ensure()
    return _state.local_rank


def local_world_size():
    """Processes on this machine: LOCAL_WORLD_SIZE as torchrun sets it (None if unknown)."""
    _ensure()
    n = env_int("LOCAL_WORLD_SIZE", None)
    if n is None and _state.world == 1:
        return 1
    return n


def set_replication(device, devices):
    """``xm.set_replication`` hook: make sure this process has joined the job."""
    _ensure()


# --------------------------------------------------------------------------------------------
# failure handling


def _dead_ranks():
    """The ranks the coordination service no longer sees (best effort: [] when it cannot say)."""
    client = _jax_distributed_client()
    if client is None or _state.world is None:
        return []
    found = []

    def ask():  # in a thread: the coordination service may be gone with rank 0
        try:
            found.append(set(client.get_live_nodes(list(range(_state.world)))))
        except Exception:
            pass

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(3.0)
    if not found:
        return []
    return [r for r in range(_state.world) if r not in found[0] and r != _state.rank]


def _install_fast_exit():
    if not env_flag("TORCHACC_FAST_EXIT"):
        return
    previous = sys.excepthook

    def excepthook(tp, value, tb):
        # print to the real stderr: an outer hook (torch.distributed's rank prefixer) may have
        # redirected sys.stderr into a buffer that it would only write out after we returned
        saved = sys.stderr
        sys.stderr = sys.__stderr__ or saved
        try:
            previous(tp, value, tb)
        finally:
            sys.stderr = sys.__stderr__ or saved
            text = str(value)
            hint = ""
            if "Gloo" in text or "NCCL" in text or "ollective" in text:
                dead = _dead_ranks()
                who = f"rank {', '.join(map(str, dead))}" if dead else "another rank"
                hint = f" A collective failed: {who} has probably died (see its log)."
            print(
                f"torchacc.distributed: rank {_state.rank} of {_state.world} stopped on an "
                f"uncaught {tp.__name__}; exiting now so that the other ranks fail fast instead "
                f"of waiting for this one.{hint}",
                file=sys.stderr,
                flush=True,
            )
            try:
                sys.stdout.flush()
            finally:
                os._exit(1)

    sys.excepthook = excepthook
