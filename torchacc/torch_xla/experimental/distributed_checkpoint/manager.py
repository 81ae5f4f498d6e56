"""``torch_xla.experimental.distributed_checkpoint.manager``: ``CheckpointManager``
(:mod:`torchacc.distributed.checkpoint_manager`)."""

from torchacc.distributed import checkpoint_manager
from torchacc.torch_xla._api import differs


@differs(
    "local paths only (no fsspec URLs); chkpt_on_preemption defaults to False and True raises "
    "(no preemption sync point); writes are atomic (temp dir + rename) and .manager_metadata "
    "is JSON, not a pickle"
)
class CheckpointManager(checkpoint_manager.CheckpointManager):
    __doc__ = checkpoint_manager.CheckpointManager.__doc__


__all__ = ["CheckpointManager"]
