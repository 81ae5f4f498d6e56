"""``torch_xla.experimental.distributed_checkpoint.util``: ``prime_optimizer``
(:func:`torchacc.distributed.checkpoint.prime_optimizer`)."""

from torchacc.distributed.checkpoint import prime_optimizer

__all__ = ["prime_optimizer"]
