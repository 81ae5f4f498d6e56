"""What every front door of the gallery trainer provides: :class:`FrontDoor`, its defaults (the
eager ones), and the AMP dtype rule shared by all.

Note [Front door hooks]
~~~~~~~~~~~~~~~~~~~~~~~
:func:`gallery.common.trainer.train` calls these, in this order, on the front door that
:func:`gallery.common.frontdoors.select` picked for the flags:

1. construction, with ``start()`` first: what must happen before the device is first used (SPMD
   mode, a parallel context); the model is then built on the host, with the same seed on every
   rank, and a one-file ``--resume`` checkpoint loaded into it;
2. ``place(model, task)``: process group, device, the model moved (and wrapped or sharded) there;
   sets ``device``, ``rank``, ``world_size``, ``cuda`` and ``mode``;
3. ``optimizer(model, lr, weight_decay, amp_dtype)``, ``grad_scaler(amp_dtype)``,
   ``autocast(amp_dtype)`` (a callable giving the step's autocast context);
4. ``compiled_step(...)``: the whole step as one program, or None (the loop runs it);
5. ``open_checkpoints(model, optimizer)``: a front door with its own checkpoint format (sharded
   DCP) opens it and returns the resumed step; None: the trainer's one-file checkpoints;
6. ``loader(dataset, workers)``: the batches this process trains on;
7. per step: ``to_device(inputs, target)``, ``reduce_gradients(optimizer)`` between backward
   and the optimizer step, ``after_step(done, model, optimizer)``; the lazy front doors end the
   step with ``xm.mark_step()`` in the loop itself (its line is the step's compile site).

A new front door subclasses the closest one and overrides only what differs; a new per-step
measurement belongs in ``gallery/common/report.py``, a new piece of saved state in
``gallery/common/saving.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

from gallery.common.data import EpochBatches

__all__ = ["FrontDoor", "resolve_amp_dtype", "to_device"]


def resolve_amp_dtype(args: argparse.Namespace, cuda: bool) -> torch.dtype | None:
    """None for O0; else the --amp_dtype, by default bf16 where supported (not on pre-Ampere
    GPUs such as V100, which get fp16)."""
    if args.amp_level == "O0":
        return None
    name = args.amp_dtype
    if name is None:
        name = "fp16" if cuda and not torch.cuda.is_bf16_supported() else "bf16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def to_device(inputs, device, **kwargs):
    """A batch's inputs (one tensor, or a tuple of them: packed rows' ids and positions) moved."""
    if isinstance(inputs, tuple):
        return tuple(t.to(device, **kwargs) for t in inputs)
    return inputs.to(device, **kwargs)


def rendezvous_kwargs() -> dict:
    """``init_process_group`` keywords for torchrun's environment. A worker restarted by torchrun
    (``--max_restarts``) gets its keys in the store under a prefix of its attempt: the static
    rendezvous keeps the agent's store across restarts, and a restarted process group read the
    dead attempt's gloo addresses from it and hung connecting to them (seen on this box)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if attempt == "0":
        return {"init_method": "env://"}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world))
    return {
        "store": dist.PrefixStore(f"torchacc/attempt{attempt}", store),
        "rank": rank,
        "world_size": world,
    }


class FrontDoor:
    """The hooks of Note [Front door hooks], with the eager defaults."""

    compiler = False  # the lazy XLA device (torchacc.torch_xla); the loop ends steps with mark_step
    dynamo = False  # the whole step compiled by torchacc.dynamo.compile_step
    sharded = False  # XLA's partitioner reduces the gradients (no explicit all-reduce)
    own_checkpoints = False  # its own checkpoint format (open_checkpoints, save)
    mode = "eager"

    def __init__(self, args: argparse.Namespace, logger):
        self.args, self.logger = args, logger
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.rank = int(os.environ["RANK"])
        self.world_size = 1
        self.cuda = False
        self.device = torch.device("cpu")
        self.optimizer_cls = torch.optim.AdamW

    # ---- set-up
    def start(self) -> None:
        pass

    def place(self, model, task):
        raise NotImplementedError

    def optimizer(self, model, lr: float, weight_decay: float, amp_dtype):
        fused = self.cuda and not self.dynamo  # compile_step traces AdamW's capturable form
        self.optimizer_cls, kwargs = torch.optim.AdamW, ({"fused": True} if fused else {})
        return self.optimizer_cls(model.parameters(), lr, weight_decay=weight_decay, **kwargs)

    def grad_scaler(self, amp_dtype):
        if amp_dtype != torch.float16:
            return None
        return torch.amp.GradScaler(self.device.type)

    def autocast(self, amp_dtype):
        device_type = self.device.type

        def cm():
            if amp_dtype is None:
                return contextlib.nullcontext()
            return torch.autocast(device_type, dtype=amp_dtype)

        return cm

    def compiled_step(self, task, model, optimizer, scaler, autocast_cm):
        return None

    def open_checkpoints(self, model, optimizer) -> int | None:
        return None

    def loader(self, dataset, workers: int) -> EpochBatches:
        a = self.args
        return EpochBatches(
            dataset,
            a.batch_size,
            self.rank,
            self.world_size,
            a.seed,
            workers=workers,
            pin_memory=self.cuda,
        )

    def hardware(self) -> str:
        """The run's device in words (``cuda:0 <name>``, ``cpu``; ``XLA:...`` when lazy)."""
        if self.device.type == "cuda":
            return f"{self.device} {torch.cuda.get_device_name(self.device)}"
        return str(self.device)

    def compile_counter(self):
        """Programs compiled so far (0 on the eager path)."""
        return lambda: 0

    # ---- per step
    def to_device(self, inputs, target, channels_last: bool = False):
        inputs = to_device(inputs, self.device, non_blocking=True)
        target = target.to(self.device, non_blocking=True)
        if self.cuda and channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, target

    def reduce_gradients(self, optimizer) -> None:
        pass  # DDP all-reduces during backward

    def after_step(self, done: int, model, optimizer) -> None:
        pass

    # ---- shared by the eager front doors
    def _init_eager_process_group(self) -> None:
        """nccl on ``cuda:LOCAL_RANK``, else gloo on the CPU; the peak-memory reading to match."""
        from gallery.common.logger import reset_peak_memory_fn, set_peak_memory_fn

        self.cuda = torch.cuda.is_available()
        if self.cuda:
            device = self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=device, **rendezvous_kwargs())
            set_peak_memory_fn(lambda: torch.cuda.max_memory_allocated(device), "cuda")
        else:
            self.device = torch.device("cpu")
            dist.init_process_group(backend="gloo", **rendezvous_kwargs())
            reset_peak_memory_fn()
        dist.barrier()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
