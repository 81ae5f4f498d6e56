"""``torchacc.utils.logger``: the ``"TorchAcc"`` logger TorchAcc's scripts log through
(``ta.utils.logger.info(...)``), at the level ``ACC_LOG_LEVEL`` names (``INFO`` by default),
writing ``[time - LEVEL] message`` lines to stderr."""

import logging
import os

logger = logging.getLogger("TorchAcc")


def _configure():
    level = os.environ.get("ACC_LOG_LEVEL", "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"ACC_LOG_LEVEL={level!r} is not a logging level (DEBUG, INFO, ...)")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s - %(levelname)s] %(message)s"))
        logger.addHandler(handler)
    logger.propagate = False


_configure()
