"""``torch_xla.distributed.fsdp`` on torchacc: the auto-wrap policies (``wrap``) that FSDPv2
(``torch_xla.experimental.spmd_fully_sharded_data_parallel``) takes. torch_xla's FSDPv1
(``XlaFullyShardedDataParallel``, parameters sharded per process by hand-written collectives) is
not provided: FSDPv2 gives the same ZeRO-3 layout through XLA's SPMD partitioner."""

from torchacc.torch_xla._api import not_implemented_class
from torchacc.torch_xla.distributed.fsdp import wrap  # noqa: F401

XlaFullyShardedDataParallel = not_implemented_class(
    "torch_xla.distributed.fsdp.XlaFullyShardedDataParallel",
    "use FSDPv2 (torch_xla.experimental.spmd_fully_sharded_data_parallel."
    "SpmdFullyShardedDataParallel) after xr.use_spmd(): the same sharding through XLA's "
    "SPMD partitioner",
)
