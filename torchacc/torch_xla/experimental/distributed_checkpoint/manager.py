"""``torch_xla.experimental.distributed_checkpoint.manager``: ``CheckpointManager``
(:mod:`torchacc.distributed.checkpoint_manager`)."""

from torchacc.distributed.checkpoint_manager import CheckpointManager

__all__ = ["CheckpointManager"]
