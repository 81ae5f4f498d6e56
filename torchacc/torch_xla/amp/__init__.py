"""``torch_xla.amp`` on torchacc: ``autocast`` (bf16 by default), a sync-free ``GradScaler`` and
the ``syncfree`` optimizers. See :mod:`torchacc.amp`."""

from torchacc.amp import GradScaler, autocast, default_dtype, set_default_dtype
from torchacc.torch_xla.amp import syncfree

__all__ = ["GradScaler", "autocast", "default_dtype", "set_default_dtype", "syncfree"]
