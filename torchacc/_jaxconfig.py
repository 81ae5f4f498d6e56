"""JAX process configuration torchacc needs before any array is made.

PyTorch has real int64/float64 tensors (indices, targets, step counters), so JAX runs with x64 on;
every rule names its dtypes explicitly, so no computation silently widens to 64 bits.

Memory: see README "Sharing a GPU with PyTorch". Unless the user chose otherwise, JAX does not
preallocate most of the GPU, so the eager baseline and the torch CUDA allocator can coexist.

XLA GPU flags: see Note [XLA GPU flags]. On a machine with a JAX GPU plugin, torchacc adds its
chosen defaults (``GPU_XLA_FLAGS``) to ``XLA_FLAGS`` before JAX starts, unless the user already
set that flag or ``TORCHACC_XLA_GPU_FLAGS=0``.
"""

import glob
import importlib.util
import mmap
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Note [XLA GPU flags]
# The XLA flags torchacc turns on for GPUs (docs/mfu.md, "XLA GPU flags"):
# - --xla_gpu_enable_latency_hiding_scheduler=true: schedule collectives (FSDP's all-gathers and
#   reduce-scatters, DP's all-reduces) to overlap with compute; NVIDIA's JAX containers set it too.
# XLA aborts the process on a flag it does not know ("Unknown flags in XLA_FLAGS"), and flags come
# and go between XLA versions. So a flag is only added when its name is a string of its own (the
# literal XLA registers the flag with) in every XLA binary that parses XLA_FLAGS here (jaxlib's
# and the GPU plugin's); otherwise it is left out silently. A flag
# the user wrote in XLA_FLAGS (either value) wins; TORCHACC_XLA_GPU_FLAGS=0 adds none.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)


def _gpu_plugin_binaries() -> list:
    """The shared libraries of installed JAX GPU plugins (``jax_plugins.xla_cuda*``, ``*rocm*``);
    empty on a CPU-only install or when ``JAX_PLATFORMS`` names only the CPU."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms and all(p.strip() == "cpu" for p in platforms.split(",")):
        return []
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return []
    found = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in glob.glob(os.path.join(root, "*")):
            name = os.path.basename(sub).lower()
            if "cuda" in name or "rocm" in name:
                found += glob.glob(os.path.join(sub, "*.so"))
    return found


def _xla_binaries() -> list:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.origin:
        return []
    root = os.path.dirname(spec.origin)
    return [p for p in glob.glob(os.path.join(root, "*.so")) if os.path.getsize(p) > 50 << 20]


def _binary_knows(path: str, name: bytes) -> bool:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(name) >= 0
    except (OSError, ValueError):
        return False


def gpu_xla_flags(xla_flags: str, env=os.environ) -> str:
    """``xla_flags`` with torchacc's GPU defaults added (Note [XLA GPU flags])."""
    if env.get("TORCHACC_XLA_GPU_FLAGS", "").strip().lower() in ("0", "false", "no", "off"):
        return xla_flags
    plugins = _gpu_plugin_binaries()
    if not plugins:
        return xla_flags
    binaries = plugins + _xla_binaries()
    added = []
    for flag in GPU_XLA_FLAGS:
        name = flag.split("=", 1)[0]
        if name in xla_flags:  # the user's choice wins
            continue
        # the name as a C string of its own (tsl::Flag's literal), not the tail of another
        if all(_binary_knows(b, b"\0" + name[2:].encode() + b"\0") for b in binaries):
            added.append(flag)
    return " ".join([xla_flags.strip(), *added]).strip()


try:
    _flags = gpu_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if _flags != os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = _flags
except Exception:  # noqa: BLE001 - a default, never a reason to fail the import
    pass

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)


def _cpu_device_count():
    """Local CPU devices asked for with torch_xla's ``CPU_NUM_DEVICES`` (read with
    ``PJRT_DEVICE=CPU`` or no ``PJRT_DEVICE``); None when unset. XLA's own
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` is honoured by XLA itself."""
    text = os.environ.get("CPU_NUM_DEVICES", "").strip()
    if not text or os.environ.get("PJRT_DEVICE", "CPU").strip().upper() != "CPU":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"torchacc: CPU_NUM_DEVICES={text!r} is not a whole number") from None
    if n < 1:
        raise ValueError(f"torchacc: CPU_NUM_DEVICES={n}: need at least one device")
    return n


if _cpu_device_count() is not None:  # Note [SPMD mode] in torchacc/sharding/mesh.py
    jax.config.update("jax_num_cpu_devices", _cpu_device_count())
