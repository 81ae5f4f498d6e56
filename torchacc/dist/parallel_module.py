"""``ta.dist.ParallelModule`` and ``ta.dist.PipelineParallel``: TorchAcc's parallel-module names
over torchacc's pipeline engine (torchacc/pipeline/, Note [Pipeline stages on the pp axis]).

``PipelineParallel(model, config)`` reads ``config.dist.pp`` (``size``, ``split_points``,
``num_micro_batches``, ``schedule``) and the ``dp`` / ``fsdp`` sizes and ``topology`` of
``config.dist``; the stages live on the ``pp`` axis of one job-wide mesh (a torchrun job's
processes included), so ``model.to(device)`` then ``model.forward_backward(...)`` runs the
whole pipelined step as one program on every process.
"""

from __future__ import annotations

import torch

from torchacc.pipeline import PipelineModule


class ParallelModule(torch.nn.Module):
    """TorchAcc's base of the parallel wrappers: ``config``, ``device``, the wrapped model
    (``_get_underlay_model`` / ``_update_underlay_model``, e.g. to checkpoint its layers after
    wrapping), ``clip_grad_norm_`` and ``forward_backward`` (pipeline parallel only)."""

    @property
    def config(self):
        return self._config

    @property
    def device(self):
        from torchacc.lazy.device import device

        return device()

    def _get_underlay_model(self):
        raise NotImplementedError(f"{type(self).__name__} wraps no model")

    def _update_underlay_model(self, model):
        raise NotImplementedError(f"{type(self).__name__}: _update_underlay_model")

    def clip_grad_norm_(self, max_grad_norm):
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_grad_norm)

    def forward_backward(self, *args, output_fn=None, **kwargs):
        raise NotImplementedError("forward_backward is only supported for pipeline parallel")


class PipelineParallel(PipelineModule, ParallelModule):
    """TorchAcc's ``ta.dist.PipelineParallel(model, config)``: ``model`` cut before each of
    ``config.dist.pp.split_points`` into ``config.dist.pp.size`` stages. A ``ValueError``
    naming the sizes (nothing changed) when ``pp.size != len(split_points) + 1``, a split point
    names no module, or (at ``forward_backward``) ``num_micro_batches`` does not divide the
    batch. ``schedule_algo=`` (TorchAcc's keyword) overrides ``config.dist.pp.schedule``."""

    def __init__(self, model, config, orig_forward_sig=None, schedule_algo=None, **kwargs):
        config.validate()
        dist = config.dist
        pp = dist.pp
        PipelineModule.__init__(
            self,
            model,
            pp.size,
            pp.split_points,
            num_micro_batches=pp.num_micro_batches,
            schedule=schedule_algo if schedule_algo is not None else pp.schedule,
            fsdp=dist.fsdp.size,
            topology=[t for t in dist.topology if t in ("dp", "fsdp", "pp")],
            dp=dist.dp.size,
        )
        if dist.tp.size > 1 or dist.sp.size > 1:
            raise NotImplementedError(
                f"ta.dist.PipelineParallel: tp.size={dist.tp.size}, sp.size={dist.sp.size}: "
                "pipeline parallel composes with dp and fsdp only"
            )
        self._config = config
        if orig_forward_sig is not None:
            self._signature = orig_forward_sig

    def _get_underlay_model(self):
        return self._underlay

    def _update_underlay_model(self, model):
        """The wrapped model after an in-place change of its modules (gradient checkpointing):
        the same module tree, so the stages pick it up on the next step."""
        if model is not self._underlay:
            raise ValueError(
                "ta.dist.PipelineParallel._update_underlay_model: expects the model "
                "_get_underlay_model() returned, changed in place"
            )
        self._steps.clear()

    def clip_grad_norm_(self, max_grad_norm):
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_grad_norm)
