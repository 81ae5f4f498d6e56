"""The TorchAcc recipe's front door (``--compiler-opt``): the lazy XLA device of
``torchacc.torch_xla``, with the recipe's calls unchanged but for the package name: the ``xla``
process group, ``xm.xla_device()`` + ``xm.set_replication``, ``syncfree.AdamW`` under AMP,
``autocast(device)`` (+ ``GradScaler()`` for fp16), ``xm._fetch_gradients`` + ``xm.all_reduce``
between backward and the update (the loop ends each step with ``xm.mark_step()``)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from gallery.common.frontdoors.base import FrontDoor, rendezvous_kwargs, to_device

__all__ = ["Compiler", "xla_peak_memory_fn"]


def xla_peak_memory_fn(xm, device) -> Callable[[], float]:
    """Peak device bytes from ``xm.get_memory_info``, whichever torch_xla-era keys it returns."""

    def read() -> float:
        info = xm.get_memory_info(device)
        for key in ("peak_bytes_used", "bytes_used"):
            if key in info:
                return float(info[key])
        if "kb_total" in info and "kb_free" in info:
            return float(info["kb_total"] - info["kb_free"]) * 1024.0
        raise KeyError(f"unexpected xm.get_memory_info keys: {sorted(info)}")

    return read


class Compiler(FrontDoor):
    compiler = True
    mode = "torchacc"
    place_before_shard = True  # the model on the device before shard() (else shard() places it)

    def __init__(self, args, logger):
        super().__init__(args, logger)
        self.start()  # before the recipe's imports: SPMD mode / a parallel context come first
        # torchacc: the TorchAcc recipe's imports, unchanged but for the package name.
        import torchacc.torch_xla.core.xla_model as xm
        import torchacc.torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")
        from torchacc.torch_xla.amp import GradScaler, autocast, syncfree

        self.xm, self._autocast, self._scaler_cls, self._syncfree = (
            xm,
            autocast,
            GradScaler,
            syncfree,
        )

    def place(self, model, task):
        from gallery.common.logger import reset_peak_memory_fn, set_peak_memory_fn

        xm = self.xm
        dist.init_process_group(backend="xla", **rendezvous_kwargs())
        device = self.device = xm.xla_device()
        xm.set_replication(device, [device])
        self.rank, self.world_size = xm.get_ordinal(), xm.xrt_world_size()
        if self.place_before_shard:
            model.to(device)
        model = self.shard(model)
        xm.mark_step()
        if xm.xla_device_hw(device) == "GPU":
            set_peak_memory_fn(xla_peak_memory_fn(xm, device), "xla")
        else:  # XLA:CPU's memory info is the machine's RAM, not this process: peak RSS instead
            reset_peak_memory_fn()
        return model

    def shard(self, model):
        """The model on the device, sharded by the front door (FSDPv2, a parallel mode)."""
        return model

    def optimizer(self, model, lr, weight_decay, amp_dtype):
        if amp_dtype is None:
            return super().optimizer(model, lr, weight_decay, amp_dtype)
        self.optimizer_cls = self._syncfree.AdamW
        return self.optimizer_cls(model.parameters(), lr, weight_decay=weight_decay)

    def grad_scaler(self, amp_dtype):
        import torch

        return self._scaler_cls() if amp_dtype == torch.float16 else None

    def autocast(self, amp_dtype):
        import contextlib

        autocast, device = self._autocast, self.device
        return lambda: (
            contextlib.nullcontext() if amp_dtype is None else autocast(device, dtype=amp_dtype)
        )

    def hardware(self) -> str:
        import torchacc

        if torchacc.device_hw() == "GPU":
            try:
                return f"XLA:GPU {torchacc.jax_device().device_kind}"
            except Exception:
                return "XLA:GPU"
        return "XLA:CPU"

    def compile_counter(self):
        import torchacc.torch_xla.debug.metrics as met

        return lambda: met.counter_value("UncachedCompile") or 0

    def to_device(self, inputs, target, channels_last: bool = False):
        return to_device(inputs, self.device), target.to(self.device)

    def reduce_gradients(self, optimizer) -> None:
        if self.sharded:  # SPMD: XLA's partitioner reduces gradients
            return
        xm = self.xm
        xm.all_reduce("sum", xm._fetch_gradients(optimizer), scale=1.0 / self.world_size)
