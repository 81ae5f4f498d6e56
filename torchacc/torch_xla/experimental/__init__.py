"""``torch_xla.experimental`` on torchacc: the eager-mode toggles (see :mod:`.eager`)."""

from torchacc.torch_xla.experimental.eager import eager_mode, eager_mode_context, is_eager_mode

__all__ = ["eager_mode", "eager_mode_context", "is_eager_mode"]
