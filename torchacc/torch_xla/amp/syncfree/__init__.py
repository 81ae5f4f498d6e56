"""``torch_xla.amp.syncfree`` on torchacc: SGD, Adam, AdamW with ``step(found_inf=...)``."""

from torchacc.amp.syncfree import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
