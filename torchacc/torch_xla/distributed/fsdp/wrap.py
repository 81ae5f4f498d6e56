"""``torch_xla.distributed.fsdp.wrap``: torch's FSDP auto-wrap policies (the same callables
``policy(module=, recurse=, nonwrapped_numel=)`` that FSDPv2's ``auto_wrap_policy`` calls)."""

from torch.distributed.fsdp.wrap import (  # noqa: F401
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
