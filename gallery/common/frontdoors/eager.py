"""The eager front door, the baseline: DDP on ``cuda:LOCAL_RANK`` (nccl) or the CPU (gloo),
channels_last + cudnn.benchmark for CNNs on a GPU, TF32 under O1, ``--torch_compile``."""

from __future__ import annotations

import torch
from torch import nn

from gallery.common.frontdoors.base import FrontDoor

__all__ = ["Eager"]


class Eager(FrontDoor):
    def place(self, model, task):
        self._init_eager_process_group()
        cuda = self.cuda
        if cuda and task.channels_last:
            model = model.to(memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = True
        if cuda:  # O1: TF32 matmuls/convolutions; O0 is exact fp32 (torch's conv default is TF32)
            tf32 = self.args.amp_level != "O0"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        model.to(self.device)
        model = self.wrap(model)
        if self.args.torch_compile:
            model = torch.compile(model)
        self.mode = "eager+compile" if self.args.torch_compile else "eager"
        return model

    def wrap(self, model):
        """The data-parallel wrapper: DDP (gradients all-reduced during backward)."""
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=[self.local_rank] if self.cuda else None,
            gradient_as_bucket_view=True,
        )
