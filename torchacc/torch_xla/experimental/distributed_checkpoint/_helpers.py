"""``torch_xla.experimental.distributed_checkpoint._helpers``: the names torch_xla's own tests
import (:mod:`torchacc.distributed.checkpoint`)."""

from torchacc.distributed.checkpoint import Shards as _CpuShards
from torchacc.distributed.checkpoint import host_state_dict as _sharded_cpu_state_dict
from torchacc.distributed.checkpoint import is_sharded
from torchacc.lazy.device import DEVICE_TYPE


def _is_sharded_tensor(x):
    """Whether ``x`` is a torchacc tensor split over devices."""
    import torch

    from torchacc.torch_xla.distributed.spmd import XLAShardedTensor

    if isinstance(x, XLAShardedTensor):
        x = x.global_tensor
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE and is_sharded(x)


__all__ = ["_CpuShards", "_is_sharded_tensor", "_sharded_cpu_state_dict"]
