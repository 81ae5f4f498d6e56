"""What the launcher checks before anything starts, and how its workers stay bounded.

Stdlib only at import time (the launcher loads it next to ``torchacc/launch.py`` without importing
the ``torchacc`` package; torch is imported inside the functions that need it).

- :func:`device_limit` / :func:`nproc_error`: ``--nproc_per_node`` above this node's devices.
- :func:`path_errors`: every path flag is usable (written to / read from) at start.
- :func:`observe_errors`: ``--tensorboard`` has a writer package, ``--profile`` a window inside
  the run and a directory.
- :func:`cuda_jax_mismatch`: torch sees CUDA GPUs while JAX has no CUDA backend.
- :func:`guard_worker` and :class:`StopRequest`: Note [Worker lifetime].

Note [Worker lifetime]
~~~~~~~~~~~~~~~~~~~~~~
A worker started by the launcher finds the launcher's pid in ``TORCHACC_LAUNCHER_PID``. First
thing, before importing torch, :func:`guard_worker` asks the kernel to SIGKILL it when its parent
dies (``prctl(PR_SET_PDEATHSIG)``; the worker is torchrun's child and torchrun runs inside the
launcher process), then checks that the launcher is still its parent (it may have died before the
prctl), and starts a daemon thread that polls ``getppid()`` as a second line of defence (no prctl
off Linux). So a launcher killed in any way, SIGKILL included, takes its workers with it.

Start-up (imports, process group, the first step with its compile) keeps SIGINT/SIGTERM at their
default action: the worker dies at once and quietly; there is nothing to save yet. After the first
step the trainer installs :class:`StopRequest`: a signal only sets a flag, the loop finishes its
step, the ranks agree on the step to stop at (``gallery/common/trainer.py``), SIGTERM saves a
checkpoint when ``--save_dir`` is set, rank 0 writes ``--output`` and prints one line, and the
worker exits ``128 + signal``. The launcher (torchrun's agent) forwards a signal it receives to the
workers, waits up to 30 s, then SIGKILLs them, and exits ``128 + signal`` without a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import time

__all__ = [
    "LAUNCHER_PID_ENV",
    "RUN_DIR_ENV",
    "cpu_count",
    "cuda_device_count",
    "device_limit",
    "nproc_error",
    "path_errors",
    "observe_errors",
    "tensorboard_writer_package",
    "jax_cuda_plugins",
    "cuda_jax_mismatch",
    "guard_worker",
    "StopRequest",
]

LAUNCHER_PID_ENV = "TORCHACC_LAUNCHER_PID"
RUN_DIR_ENV = "TORCHACC_RUN_DIR"  # the launcher's scratch directory (interrupt marker)


# ----------------------------------------------------------------------------- devices
def cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _nvidia_driver_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")


def cuda_device_count() -> int:
    """GPUs torch can see (``CUDA_VISIBLE_DEVICES`` applies); 0 without CUDA torch. Without an
    NVIDIA driver on Linux it answers 0 without importing torch (fast usage errors)."""
    if sys.platform.startswith("linux") and not _nvidia_driver_present():
        return 0
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:
        return 0


def _forced_cpu(environ) -> bool:
    return environ.get("TORCHACC_DEVICE", "").strip().lower() == "cpu"


def device_limit(compiler_opt: bool, environ=None) -> tuple[int, str]:
    """(most worker processes this node can run, one per device; the devices in words).

    GPUs when torch sees any (both paths put one process on each), else CPU cores. With
    ``--compiler-opt`` and ``TORCHACC_DEVICE=cpu`` the compiler runs on the CPU: CPU cores.
    """
    env = os.environ if environ is None else environ
    gpus = cuda_device_count()
    if gpus > 0 and not (compiler_opt and _forced_cpu(env)):
        return gpus, f"{gpus} visible GPU(s)"
    cpus = cpu_count()
    return cpus, f"{cpus} CPU core(s) ({'TORCHACC_DEVICE=cpu' if gpus else 'no GPU'})"


def _cpu_devices_per_process(env) -> int:
    """XLA:CPU devices each process gets: ``CPU_NUM_DEVICES`` (torch_xla's variable, read by
    ``torchacc/_jaxconfig.py``) or XLA's ``--xla_force_host_platform_device_count``, else 1."""
    text = env.get("CPU_NUM_DEVICES", "").strip()
    if text and env.get("PJRT_DEVICE", "CPU").strip().upper() == "CPU" and text.isdigit():
        return max(int(text), 1)
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return max(int(m.group(1)), 1) if m else 1


def compiler_devices(nproc: int, environ=None) -> int:
    """The devices ``--compiler-opt`` workers drive on this node: its GPUs (all of them, by one
    process or one each), else ``nproc`` x each process's XLA:CPU devices."""
    env = os.environ if environ is None else environ
    gpus = cuda_device_count()
    if gpus > 0 and not _forced_cpu(env):
        return gpus
    return nproc * _cpu_devices_per_process(env)


def nproc_error(nproc: int, compiler_opt: bool, oversubscribe: bool) -> str | None:
    """The error line for ``--nproc_per_node nproc`` on this node, or None if it fits."""
    limit, what = device_limit(compiler_opt)
    if nproc <= limit:
        return None
    gpus = "GPU" in what
    if oversubscribe and not gpus:
        return None
    hint = f"use --nproc_per_node <= {limit}"
    if not gpus:
        hint += ", or add --oversubscribe to run more processes than CPU cores"
    return f"--nproc_per_node {nproc} exceeds this node's {what}: {hint}"


# ----------------------------------------------------------------------------- paths
def _probe_dir(path: str) -> str | None:
    """Create ``path`` if needed and write a file in it; the reason it fails, or None."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".torchacc-probe-", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _writable_dir(flag: str, path: str) -> str | None:
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path}: exists and is not a directory"
    why = _probe_dir(path)
    return None if why is None else f"{flag} {path}: cannot write there ({why})"


def _writable_file(flag: str, path: str) -> str | None:
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory, expected a file name"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is not a directory"
    why = _probe_dir(parent)
    return None if why is None else f"{flag} {path}: cannot write in {parent} ({why})"


def _readable(flag: str, path: str) -> str | None:
    if not os.path.exists(path):
        return f"{flag} {path}: does not exist"
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
    except OSError as e:
        return f"{flag} {path}: cannot read it ({e.strerror or type(e).__name__})"
    return None


def path_errors(args, environ=None) -> list[str]:
    """One line per unusable path flag (``--save_dir``, ``--output``, ``--data``, ``--resume``,
    and with ``--compiler-opt`` the compile cache ``TORCHACC_CACHE_DIR``)."""
    env = os.environ if environ is None else environ
    errors = []
    if getattr(args, "save_dir", None):
        errors.append(_writable_dir("--save_dir", args.save_dir))
    if getattr(args, "output", None):
        errors.append(_writable_file("--output", args.output))
    if getattr(args, "data", "mock") != "mock":
        errors.append(_readable("--data", args.data))
    if getattr(args, "resume", None):
        errors.append(_readable("--resume", args.resume))
    for flag in ("tensorboard", "profile_dir"):
        if getattr(args, flag, None):
            errors.append(_writable_dir(f"--{flag}", getattr(args, flag)))
    cache = env.get("TORCHACC_CACHE_DIR")
    if getattr(args, "compiler_opt", False) and cache and cache.lower() not in ("0", "off", "none"):
        errors.append(_writable_dir("TORCHACC_CACHE_DIR", cache))
    return [e for e in errors if e]


# ----------------------------------------------------------------------------- observing
def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def tensorboard_writer_package(importable=_importable) -> str | None:
    """The package a TensorBoard writer comes from: ``tensorboard`` (for torch's
    ``torch.utils.tensorboard``), else ``tensorboardX``; None when neither is installed."""
    for name in ("tensorboard", "tensorboardX"):
        if importable(name):
            return name
    return None


def observe_errors(args, total_steps: int | None = None, importable=_importable) -> str | None:
    """The first problem of ``--tensorboard`` / ``--profile`` (one line), or None. ``total_steps``
    is the run's length when known (the worker knows it; the launcher only has --max_steps)."""
    if getattr(args, "tensorboard", None) and tensorboard_writer_package(importable) is None:
        return (
            f"--tensorboard {args.tensorboard}: needs the tensorboard package (pip install "
            "tensorboard) or tensorboardX; neither is installed"
        )
    window = getattr(args, "profile", None)
    if window is None:
        return None
    start, stop = (int(x) for x in window.split(":"))
    if start >= stop:
        return (
            f"--profile {window}: START must be < STOP (it captures steps START+1..STOP, "
            f"e.g. --profile {start}:{start + 3})"
        )
    if total_steps is not None and stop > total_steps:
        return f"--profile {window}: STOP {stop} is beyond the run's {total_steps} steps"
    max_steps = getattr(args, "max_steps", None)
    if max_steps is not None and stop > max_steps:
        return f"--profile {window}: STOP {stop} is beyond --max_steps {max_steps}"
    if not getattr(args, "profile_dir", None):
        return "--profile needs a directory: --profile_dir DIR, or --tensorboard DIR"
    return None


# ----------------------------------------------------------------------------- CUDA vs JAX
_PLUGIN = re.compile(r"^jax[-_]cuda(\d+)[-_](plugin|pjrt)$", re.IGNORECASE)


def jax_cuda_plugins() -> list[str]:
    """Installed JAX CUDA plugin distributions (``jax-cuda12-plugin`` ...); no backend starts."""
    from importlib import metadata

    found = set()
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") or ""
        if _PLUGIN.match(name):
            found.add(name.lower().replace("_", "-"))
    return sorted(found)


def _jax_platforms_exclude_gpu(environ) -> bool:
    text = environ.get("JAX_PLATFORMS", "").strip().lower()
    if not text:
        return False
    names = {p.strip() for p in text.split(",")}
    return not names & {"cuda", "gpu", "rocm"}


def cuda_jax_mismatch(
    torch_gpus: int, plugins: list[str], environ=None, jax_sees_gpu: bool | None = None
) -> str | None:
    """Why JAX would run on the CPU while torch sees ``torch_gpus`` CUDA GPUs, and the fix; None
    when there is no mismatch or ``TORCHACC_DEVICE=cpu`` says the CPU is meant. ``jax_sees_gpu``:
    what JAX reported, when it has started (None: not asked, the launcher does not start it)."""
    env = os.environ if environ is None else environ
    if torch_gpus <= 0 or _forced_cpu(env) or jax_sees_gpu:
        return None
    if not plugins:
        why = "JAX has no CUDA backend installed (the CPU build of jax)"
        fix = "pip install -e '.[cuda12]' (or '.[cuda13]', matching your CUDA)"
    elif _jax_platforms_exclude_gpu(env):
        why = f"JAX_PLATFORMS={env['JAX_PLATFORMS']} hides the GPU from JAX"
        fix = "unset JAX_PLATFORMS (or include cuda in it)"
    elif jax_sees_gpu is False:
        why = f"JAX's CUDA backend ({', '.join(plugins)}) found no usable GPU"
        fix = "install the plugin matching your CUDA driver ('.[cuda12]' or '.[cuda13]')"
    else:
        return None
    return (
        f"torch sees {torch_gpus} CUDA GPU(s) but {why}, so torchacc (--compiler-opt) would run "
        f"on XLA:CPU; fix: {fix}, or set TORCHACC_DEVICE=cpu if the CPU is meant"
    )


# ----------------------------------------------------------------------------- workers
def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except Exception:
        return False


def _watch_parent(launcher_pid: int, period: float) -> None:
    while True:
        time.sleep(period)
        if os.getppid() != launcher_pid:
            os._exit(1)


_guarded = [False]


def guard_worker(environ=None, period: float = 0.5) -> bool:
    """Tie this worker's life to the launcher's and keep start-up signals quiet (Note [Worker
    lifetime]). Returns True when a launcher pid was found. Idempotent."""
    env = os.environ if environ is None else environ
    if _guarded[0]:
        return True
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
    text = env.get(LAUNCHER_PID_ENV, "")
    if not text.isdigit():
        return False
    launcher = int(text)
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before the prctl
        os._exit(1)
    threading.Thread(
        target=_watch_parent, args=(launcher, period), name="torchacc-parent-watch", daemon=True
    ).start()
    _guarded[0] = True
    return True


class StopRequest:
    """After start-up: SIGINT/SIGTERM ask the training loop to stop at a step boundary."""

    def __init__(self):
        self.signum: int | None = None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        if self.signum is None:  # later signals (Ctrl-C reaches launcher and workers) add nothing
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
