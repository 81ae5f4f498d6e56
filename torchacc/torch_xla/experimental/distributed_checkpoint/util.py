"""``torch_xla.experimental.distributed_checkpoint.util``: ``prime_optimizer``."""

from __future__ import annotations

import torch

import torchacc


def prime_optimizer(optimizer):
    """Create ``optimizer``'s state so a checkpoint can be loaded into it in place: one step
    with zero gradients. It changes the parameters (weight decay, momentum), so call it only
    right before restoring a checkpoint that overwrites them."""
    torchacc.sync()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    torchacc.sync()
    return optimizer
