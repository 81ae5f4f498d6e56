"""The pipeline-parallel front door (``--fsdp --compiler-opt --pp N``): the model's blocks cut
evenly into N stages on the ``pp`` axis of a (dp, fsdp, pp) mesh of every device
(``torchacc.pipeline``, what ``ta.dist.PipelineParallel`` runs), each step one
``forward_backward`` over ``--num_micro_batches`` micro-batches (``--pp_schedule``: 1F1B or
GPipe), then the optimizer's update of the packed stage parameters. With ``--tp``/``--cp`` the
stages are uniform ones (``torchacc.pipeline.uniform``: Megatron's pairs on ``tp`` and context
parallel on ``sp`` inside each stage) on a (dp, pp, sp, tp) mesh, fsdp size 1 and dp the devices
left; LLaMA runs as ``Llama.chained()`` (one chain ``x = block(x)``).

The model is traced with ``torch.fx`` through :class:`BatchInputs`, a ``forward`` taking exactly
the batch's inputs (the token ids, and a packed row's position ids), so an optional argument a
batch does not pass is Python's ``None`` in the trace. The split points are the blocks of the
model's longest ``nn.ModuleList`` at ``round(k * blocks / N)``, k = 1..N-1. The log shows the mesh,
the split points and each device's parameter bytes, as ``--tp``/``--cp`` do.
"""

from __future__ import annotations

from torch import nn

from gallery.common.exits import exit_reported
from gallery.common.frontdoors.fsdp import FSDPv2, _as_tuple

__all__ = ["Pipeline", "BatchInputs", "even_split_points"]


class BatchInputs(nn.Module):
    """``model`` called with the ``n`` tensors of a batch's inputs, nothing else (what the
    pipeline's fx trace sees as the forward's arguments)."""

    def __init__(self, model: nn.Module, n: int):
        super().__init__()
        self.model, self.n = model, n

    def forward(self, idx, position_ids=None):
        if self.n == 1:
            return self.model(idx)
        return self.model(idx, position_ids)


def even_split_points(model: nn.Module, stages: int) -> list[str]:
    """Module names cutting the blocks of ``model``'s longest ``nn.ModuleList`` into ``stages``
    parts (before block ``round(k * blocks / stages)``, k = 1..stages-1); ``ValueError`` naming
    the sizes when there are fewer blocks than stages."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of blocks to cut into stages")
    name, blocks = max(lists, key=lambda nm: len(nm[1]))
    if len(blocks) < stages:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages} blocks; {name} has {len(blocks)}"
        )
    return [f"{name}.{round(k * len(blocks) / stages)}" for k in range(1, stages)]


class Pipeline(FSDPv2):
    """FSDPv2's set-up (SPMD mode, the sharded batch upload, the memory report after step 2)
    with the model as a ``PipelineModule`` on a (dp, fsdp, pp) mesh (with ``--tp``/``--cp`` a
    ``UniformPipelineModule`` on a (dp, pp, sp, tp) one) and the step its ``forward_backward``."""

    batch_axes = ("dp", "fsdp")
    place_before_shard = False  # cut and packed on the host, then placed

    def shard(self, model):
        model = self.pipeline(model)
        model.to(self.device)
        self._log_placement(model)
        return model

    def pipeline(self, model):
        """``model`` (on the host) cut into ``--pp`` stages of a (dp, fsdp, pp) mesh, or with
        ``--tp``/``--cp`` uniform stages of a (dp, pp, sp, tp) mesh."""
        import numpy as np

        import torchacc.torch_xla.distributed.spmd as xs
        import torchacc.torch_xla.runtime as xr
        from torchacc.pipeline import pipeline_parallel

        args, n, pp = self.args, xr.global_runtime_device_count(), self.args.pp
        tp, cp = getattr(args, "tp", 1), getattr(args, "cp", 1)
        inner = tp * cp  # uniform stages (tp / cp inside them): no fsdp, the rest is dp
        rest = n // (pp * inner) if n % (pp * inner) == 0 else 0
        data, shards = (int(x) for x in args.mesh.split(",")) if args.mesh else (1, rest)
        if inner > 1 and not args.mesh:
            data, shards = rest, 1
        flags = f"--pp {pp}" + "".join(f" --{k} {v}" for k, v in (("tp", tp), ("cp", cp)) if v > 1)
        if data * shards * pp * inner != n:
            line = (
                f"--mesh {data},{shards} x {flags} holds {data * shards * pp * inner} devices; "
                f"this job has {n}"
                if args.mesh
                else f"{flags}: {pp * inner} devices do not divide this job's {n}"
            )
            raise exit_reported(2, f"error: {line}", self.rank)
        micro = args.num_micro_batches or pp
        batch = args.batch_size * self.world_size
        if batch % (micro * data * shards):
            line = (
                f"{flags}: the global batch of {batch} samples is not divisible by "
                f"{micro} micro-batches x {data * shards} data-parallel devices (dp x fsdp)"
            )
            raise exit_reported(2, f"error: {line}", self.rank)
        if inner > 1:  # the engine's uniform-stage mesh; its sp axis is the launcher's --cp
            self.batch_axes = ("dp",)
            self.mesh = xs.Mesh(np.arange(n), (data, pp, cp, tp), ("dp", "pp", "sp", "tp"))
        else:
            self.mesh = xs.Mesh(np.arange(n), (data, shards, pp), ("dp", "fsdp", "pp"))
        self.cp = 1  # the batch is split by rows only; the stages split the sequence over sp
        packed = getattr(args, "packing", False)
        if inner > 1 and hasattr(model, "chained"):  # LLaMA: blocks read (x, cos, sin)
            if packed:
                line = (
                    f"{flags} --packing: uniform stages compute LLaMA's rotary tables from the "
                    "sequence length; a packed row's position ids do not cross the stages"
                )
                raise exit_reported(2, f"error: {line}", self.rank)
            model = model.chained()  # x = block(x), the chain uniform stages cut
        wrapped = BatchInputs(model, 2 if packed else 1)
        try:
            points = even_split_points(wrapped, pp)
            module = pipeline_parallel(
                wrapped,
                self.mesh.get_jax_mesh(),
                points,
                num_micro_batches=micro,
                schedule=args.pp_schedule,
            )
        except (ValueError, NotImplementedError) as e:
            raise exit_reported(2, f"error: {flags}: {e}", self.rank) from None
        self.summary = (data, shards, pp, tp, cp, points, micro)
        return module

    def _log_placement(self, model) -> None:
        from torchacc.sharding import api

        data, shards, pp, tp, cp, points, micro = self.summary
        per_device = api.per_device_bytes(list(model.parameters()))
        unsharded = sum(p.numel() * p.element_size() for p in model.unpacked().values())
        axes = "".join(f" x {k}={v}" for k, v in (("cp", cp), ("tp", tp)) if v > 1)
        self.logger.info(
            f"pp: mesh dp={data} x fsdp={shards} x pp={pp}{axes}; stages cut before "
            f"{', '.join(points)}; {micro} micro-batches ({model.schedule}); parameter bytes per "
            f"device {max(per_device.values()) if per_device else 0:,} (unsharded {unsharded:,})"
        )

    def compiled_step(self, task, model, optimizer, scaler, autocast_cm):
        """One step: ``forward_backward`` of the micro-batches (gradients into the packed
        parameters' ``.grad``), the optimizer's update, ``mark_step``."""
        if scaler is not None:
            line = (
                "--pp: fp16's GradScaler does not apply to the pipeline step; use --amp_dtype bf16"
            )
            raise exit_reported(2, f"error: {line}", self.rank)
        xm, loss_fn = self.xm, task.loss_fn

        def output_fn(logits, target):
            return loss_fn(logits, target)

        def step(inputs, target):
            optimizer.zero_grad(set_to_none=True)
            with autocast_cm():
                loss = model.forward_backward(
                    *_as_tuple(inputs), target=target, output_fn=output_fn
                )
            optimizer.step()
            xm.mark_step()
            return loss

        return step
