"""``torchacc.utils``: the helpers AlibabaPAI/torchacc's scripts import from it --
``checkpoint.gradient_checkpoint(model, gc_cls)`` and ``logger`` (the ``"TorchAcc"`` logger)."""

from torchacc.utils import checkpoint
from torchacc.utils.logger import logger

__all__ = ["checkpoint", "logger"]
