"""``torch_xla.experimental.distributed_checkpoint`` on torchacc: DCP planners for sharded
tensors and the step-numbered ``CheckpointManager``.

Use them with ``torch.distributed.checkpoint`` as with torch_xla::

    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path), planner=SPMDSavePlanner())
    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner())

The engine is :mod:`torchacc.distributed.checkpoint` (Note [Sharded checkpoints]): each process
writes only its own unique shards, and loading reshards into the tensors' current layout.
``SafeFileSystemReader`` (a torchacc addition) reads the checkpoint's metadata without
unpickling anything but DCP's metadata classes.
"""

from torchacc.torch_xla.experimental.distributed_checkpoint.manager import CheckpointManager
from torchacc.torch_xla.experimental.distributed_checkpoint.planners import (
    SafeFileSystemReader,
    SPMDLoadPlanner,
    SPMDSavePlanner,
)
from torchacc.torch_xla.experimental.distributed_checkpoint.util import prime_optimizer

__all__ = [
    "CheckpointManager",
    "SPMDLoadPlanner",
    "SPMDSavePlanner",
    "SafeFileSystemReader",
    "prime_optimizer",
]
