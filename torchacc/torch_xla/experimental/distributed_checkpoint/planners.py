"""``torch_xla.experimental.distributed_checkpoint.planners``: the DCP planners for sharded
torchacc tensors (:mod:`torchacc.distributed.checkpoint`)."""

from torchacc.distributed.checkpoint import (
    SafeFileSystemReader,
    SPMDLoadPlanner,
    SPMDSavePlanner,
)

__all__ = ["SPMDLoadPlanner", "SPMDSavePlanner", "SafeFileSystemReader"]
