"""``torchacc.nn``: module wrappers for the drop-ins (``torchacc.nn.parallel``)."""

from torchacc.nn import parallel  # noqa: F401
