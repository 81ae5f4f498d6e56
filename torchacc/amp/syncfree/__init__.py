"""Optimizers whose ``step(closure=None, found_inf=None)`` skips an overflowing AMP step on the
device, with no host read: ``SGD``, ``Adam``, ``AdamW`` (torch.optim's arguments and math).
``torchacc.amp.GradScaler.step`` passes ``found_inf`` to them automatically."""

from torchacc.amp.syncfree.adam import Adam, AdamW
from torchacc.amp.syncfree.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW"]
