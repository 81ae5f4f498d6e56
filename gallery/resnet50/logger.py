"""``from logger import create_logger, enable_torchacc_compiler, enable_torchacc_kernel,
log_params, log_metrics`` as in TorchAcc's ResNet-50 recipe.

The implementation is shared by every gallery model and lives in :mod:`gallery.common.logger`
(including the peak-memory hook: :func:`set_peak_memory_fn` / :func:`peak_memory_gib`).
"""

from gallery.common.logger import (  # noqa: F401
    create_logger,
    enable_torchacc_compiler,
    enable_torchacc_kernel,
    format_duration,
    log_metrics,
    log_params,
    peak_memory_gib,
    reset_peak_memory_fn,
    set_peak_memory_fn,
)

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
