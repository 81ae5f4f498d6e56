"""Logging helpers of the TorchAcc recipes (``from logger import create_logger, ...`` in the seed).

* :func:`enable_torchacc_compiler` / :func:`enable_torchacc_kernel`: the switches, read from the
  environment (``TORCHACC_COMPILER_OPT=1`` / ``TORCHACC_KERNEL_OPT=1``; the launcher sets them from
  ``--compiler-opt`` / ``--kernel-opt``).
* :func:`create_logger`, :func:`log_params`, :func:`log_metrics`: rank 0 prints, the other ranks
  only warn.
* Peak memory hook: the training code registers where peak memory is read
  (:func:`set_peak_memory_fn`) and :func:`peak_memory_gib` reads it. Eager CUDA registers
  ``torch.cuda.max_memory_allocated``; the compiler path on a GPU registers its device's reading
  (``xm.get_memory_info``); with nothing registered (the CPU, either path) it reports the peak
  resident set size of this process (``getrusage(RUSAGE_SELF).ru_maxrss``), labelled
  ``host_rss``. Readings are a running maximum per source, so a peak never goes down.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

__all__ = [
    "create_logger",
    "enable_torchacc_compiler",
    "enable_torchacc_kernel",
    "log_params",
    "log_metrics",
    "format_duration",
    "set_peak_memory_fn",
    "reset_peak_memory_fn",
    "peak_memory_gib",
]

_GIB = float(1 << 30)
_logger: logging.Logger | None = None
_peak_memory_fn: Callable[[], float] | None = None
_peak_memory_source = "host_rss"
_peak_seen: dict[str, float] = {}  # source -> highest reading so far (GiB)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def enable_torchacc_compiler() -> bool:
    """True when the run goes through torchacc's compiler (``--compiler-opt``)."""
    return _truthy("TORCHACC_COMPILER_OPT")


def enable_torchacc_kernel() -> bool:
    """True when the gallery models use ``torchacc_ops``' fused kernels (``--kernel-opt``), on the
    compiler path and on the eager one."""
    return _truthy("TORCHACC_KERNEL_OPT")


def create_logger(name: str = "torchacc.gallery", rank: int | None = None) -> logging.Logger:
    """A logger printing to stdout on rank 0 (INFO) and to stderr elsewhere (WARNING and up)."""
    global _logger
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.propagate = False
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter(f"[%(asctime)s rank{rank}] %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    _logger = logger
    return logger


def _get_logger() -> logging.Logger:
    return _logger if _logger is not None else create_logger()


def log_params(params, logger: logging.Logger | None = None, **extra) -> None:
    """One line per setting (an argparse Namespace, a dict, or keyword arguments)."""
    logger = logger or _get_logger()
    items = dict(vars(params) if hasattr(params, "__dict__") else params or {})
    items.update(extra)
    logger.info("parameters:")
    for key in sorted(items):
        logger.info(f"  {key:<22} {items[key]}")


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "?"
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def log_metrics(
    epoch: int,
    step: int,
    batch_size: int,
    loss,
    batch_time: float,
    samples_per_step: float,
    peak_mem: float,
    *,
    total_steps: int | None = None,
    eta: float | None = None,
    mem_source: str | None = None,
    loss_scale: float | None = None,
    logger: logging.Logger | None = None,
    tokens_per_sec: float | None = None,
    flops: dict | None = None,
) -> str:
    """The progress line. ``samples_per_step`` is samples/s over all processes, ``batch_time`` is
    seconds per step, ``peak_mem`` GiB, ``step`` the number of steps done, ``loss_scale`` the
    GradScaler's scale (shown when given), ``tokens_per_sec`` over all processes (language
    models), ``flops`` the step program's ``{"tflops": per device, "mfu": fraction or None}``
    (:func:`flops_text`; the compiler path)."""
    logger = logger or _get_logger()
    loss = float(loss.item() if hasattr(loss, "item") else loss)
    where = (
        f"{step}/{total_steps} ({100.0 * step / total_steps:3.0f}%)" if total_steps else f"{step}"
    )
    scale = "" if loss_scale is None else f" (scale {loss_scale:g})"
    line = (
        f"epoch {epoch} step {where} | batch {batch_size} | loss {loss:.4f}{scale} | "
        f"{batch_time * 1000.0:.1f} ms/step | {samples_per_step:.1f} samples/s | "
    )
    if tokens_per_sec is not None:
        line += f"{tokens_per_sec:,.0f} tokens/s | "
    if flops is not None:
        line += flops_text(flops) + " | "
    line += f"peak mem {peak_mem:.2f} GiB"
    if mem_source:
        line += f" ({mem_source})"
    if total_steps:
        line += f" | ETA {format_duration(eta)}"
    logger.info(line)
    return line


def flops_text(flops: dict) -> str:
    """``123.4 TFLOP/s/device, MFU 41.2%`` (``MFU n/a`` where the device's peak is unknown: a
    CPU without ``--peak_tflops``)."""
    mfu = flops.get("mfu")
    return f"{flops['tflops']:.3g} TFLOP/s/device, MFU " + (
        "n/a" if mfu is None else f"{100.0 * mfu:.1f}%"
    )


# ----------------------------------------------------------------------------- peak memory hook
def set_peak_memory_fn(fn: Callable[[], float], source: str) -> None:
    """Register ``fn() -> bytes`` as the peak-memory reading, labelled ``source``."""
    global _peak_memory_fn, _peak_memory_source
    _peak_memory_fn, _peak_memory_source = fn, source
    _peak_seen.clear()


def reset_peak_memory_fn() -> None:
    global _peak_memory_fn, _peak_memory_source
    _peak_memory_fn, _peak_memory_source = None, "host_rss"
    _peak_seen.clear()


def _host_peak_rss_bytes() -> float:
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(kb) * (1.0 if sys.platform == "darwin" else 1024.0)
    except Exception:  # pragma: no cover - non-POSIX
        return 0.0


def _monotone(value: float, source: str) -> tuple[float, str]:
    value = max(value, _peak_seen.get(source, 0.0))
    _peak_seen[source] = value
    return value, source


def peak_memory_gib() -> tuple[float, str]:
    """(peak memory in GiB so far, where it was read). Falls back to host RSS if the hook fails."""
    if _peak_memory_fn is not None:
        try:
            return _monotone(float(_peak_memory_fn()) / _GIB, _peak_memory_source)
        except Exception as e:  # a broken hook must not kill a training run
            _get_logger().warning(f"peak memory hook ({_peak_memory_source}) failed: {e!r}")
    return _monotone(_host_peak_rss_bytes() / _GIB, "host_rss")
