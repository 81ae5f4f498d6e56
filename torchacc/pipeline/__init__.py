"""Pipeline parallel on the one mesh: a model's stages on the ``pp`` axis, GPipe and 1F1B as one
compiled step (``ta.dist.PipelineParallel`` is TorchAcc's front door to it, ``accelerate`` with
``Config.dist.pp.size > 1`` another). ``stages.py`` cuts the model (torch.fx), ``module.py`` owns
the packed parameters and records the step, ``schedules.py`` is the JAX region; ``uniform.py``
the stages every device runs alike, for tp / sp inside a stage and scan_layers (Note [Uniform
pipeline stages] there).

Note [Pipeline stages on the pp axis]
    The model's forward is traced once with torch.fx (split-point modules kept whole) and cut
    *before* each split point (TorchAcc's rule): stage k runs the nodes between split points k-1
    and k. What a stage hands on is every value computed by it or an earlier stage and read by a
    later one (skips are carried through the stages between); the model's inputs and the
    output_fn's arguments are not handed on: every stage reads the micro-batch's own. Each stage
    is traced (on fake tensors, its parameters as inputs) into one FX graph whose lowering rules
    make its JAX function.

    Parameters: one read by a single stage is packed into that stage's row of a ``[pp, width]``
    tensor per (dtype, requires_grad), split over ``pp`` (and over ``fsdp`` along the row), so a
    device holds only its stage's parameters (the widest stage's, with padding). One read by
    several stages (tied embeddings) stays whole, replicated, its gradient summed over stages.
    Buffers are replicated. An optimizer over ``parameters()`` updates the rows elementwise, as
    it would the separate tensors (per-parameter options -- param groups by name -- are lost).

    The step is one ``jax.shard_map`` manual over ``pp``, the batch axes (dp, fsdp) and the
    parameter axis (fsdp), other axes automatic. Every device runs its stage with
    ``lax.switch`` on its ``pp`` index; boundary values travel as one flat buffer per dtype with
    ``lax.ppermute`` (s -> s+1; gradients s+1 -> s). No collective runs inside a stage's branch
    (different stages take different branches): fsdp's all-gather of the row comes before the
    loop, its reduce-scatter after.

    GPipe: a ``lax.scan`` over M + S - 1 ticks, stage s running micro-batch t - s; the backward
    is JAX's VJP of that scan (a reverse scan), which keeps each tick's residuals (M micro-
    batches in flight; gradient checkpointing makes each stage a ``jax.checkpoint``, keeping
    only stage inputs). 1F1B (TorchAcc's PipeDreamFlush): a scan over M + 2 (S - 1) ticks, each
    tick one forward (micro-batch t - s) and one backward (micro-batch t - 2 (S - 1) + s), the
    backward recomputing its stage's forward from the stashed stage input (``jax.vjp``); a
    device stashes at most min(M, 2 S - 1) stage inputs, whatever M. Gradients accumulate in the
    loop's carry; the loss is the mean over micro-batches (and data-parallel shards). Dropout
    draws from the step's RNG key folded with the micro-batch and the stage, the same in a
    backward's recompute. One node forward, gradients accumulated into ``.grad``: no recompile
    after the first step.

    Stages that run collectives themselves (tp, sp) cannot be switch branches (a collective in
    one branch deadlocks XLA:CPU while other devices run another): they are uniform stages,
    Note [Uniform pipeline stages] in uniform.py.
"""

from __future__ import annotations

from torchacc.pipeline.module import PipelineModule, schedule_name
from torchacc.pipeline.stages import resolve_split_points

__all__ = ["PipelineModule", "pipeline_parallel", "resolve_split_points", "schedule_name"]


def pipeline_parallel(
    model,
    mesh,
    split_points,
    num_micro_batches=1,
    schedule="1f1b",
    axis="pp",
    scan_layers=False,
    sp_algorithm="auto",
):
    """``model`` (on the CPU) cut before each of ``split_points`` (module names or modules) into
    ``len(split_points) + 1`` stages on ``axis`` of ``mesh`` (a jax Mesh; its ``dp`` / ``fsdp``
    axes split the batch, ``fsdp`` the parameters too). Returns a :class:`PipelineModule`:
    ``forward_backward(*inputs, output_fn=..., **kwargs)`` returns the loss and accumulates
    gradients. ``schedule``: ``"1F1B"`` (TorchAcc's PipeDreamFlush) or ``"GPipe"``. A ``tp``
    axis (Megatron pairs), an ``sp`` axis (context parallel, ``sp_algorithm``) or
    ``scan_layers`` run uniform stages: each stage's blocks one scan (Note [Uniform pipeline
    stages] in uniform.py). What the launcher calls for ``--pp``."""
    size = int(dict(mesh.shape)[axis]) if mesh is not None else len(split_points or []) + 1
    shape = dict(mesh.shape) if mesh is not None else {}
    tp, sp = int(shape.get("tp", 1)), int(shape.get("sp", 1))
    kw = dict(num_micro_batches=num_micro_batches, schedule=schedule, mesh=mesh, axis=axis)
    if tp > 1 or sp > 1 or scan_layers:
        from torchacc.pipeline.uniform import UniformPipelineModule

        return UniformPipelineModule(
            model, size, split_points, tp=tp, sp=sp, sp_algorithm=sp_algorithm, **kw
        )
    return PipelineModule(model, size, split_points, **kw)
