"""A pipeline-parallel plan's step: ``torchacc.pipeline``'s own program (the one
``ta.dist.PipelineParallel.forward_backward`` records) with the optimizer update after it,
compiled from abstract shapes in the planner's worker; and whether a model can be cut into
stages at all (``pipelinable``, what ``--search`` asks before it offers pp layouts).

Note [What the planner compiles under pp]
For ``pp > 1`` the planner does not compile its own one-stage stand-in: it builds the model
under ``FakeTensorMode`` (no weight allocated), wraps it in ``PipelineModule`` (the class
``ta.dist.PipelineParallel`` is, with the same sizes, topology and schedule: 1F1B), cut before
layers ``L/pp, 2 L/pp, ...`` of the model's repeated blocks, and asks it for the step of one
global batch (``PipelineModule._build``: the stages traced on stand-ins, GPipe/1F1B as one
``shard_map`` over ``pp`` with ``ppermute``). That JAX function runs inside one ``jax.jit``
followed by the optimizer update of the packed rows and shared parameters (AdamW or SGD with
momentum, as compile.py writes it), parameters and optimizer state donated, the packed rows laid
out ``("pp", fsdp)`` and everything else replicated, as ``PipelineModule._place`` lays them out.
So memory, collectives (the pp axis' ``collective-permute`` s included) and FLOPs are the
compiled pipeline program's: every micro-batch of the step, the schedule's bubble ticks and its
stashed stage inputs. Loss: ``lm_loss`` (cross entropy of the logits in fp32), the
``output_fn`` a real run passes. The model's forward must be torch.fx-traceable, as
``PipelineParallel`` requires.

Note [FLOPs of the pipelined step]
XLA's cost analysis counts a while loop's body once. The schedule is one loop (a ``lax.scan`` of
M + 2 (S - 1) ticks for 1F1B, every device running its stage's branch on every tick, bubble
ticks included); the plan multiplies the program's FLOPs and bytes accessed by the loop's trip
count (``known_trip_count`` in the compiled HLO). That also multiplies the optimizer update
outside the loop (elementwise: a few FLOPs per parameter against 6 per parameter and token), and
makes the estimate the work the devices execute, the bubble included: the roofline adds no
bubble factor on top.
"""

from __future__ import annotations

import math
import os
import re
import time

import torch


def lm_loss(logits, labels):
    """The pipeline step's ``output_fn``: cross entropy of the logits (in fp32) and labels."""
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )


class TokensOnly(torch.nn.Module):
    """``model`` called with the token ids alone: what torch.fx sees as the forward's one input
    (an optional argument left out, ``position_ids=None``, would otherwise trace as a tensor)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids)


def pipelinable(spec):
    """Whether ``ta.dist.PipelineParallel`` can cut ``spec``'s model into stages."""
    return why_not_pipelinable(spec) is None


def why_not_pipelinable(spec):
    """None when ``ta.dist.PipelineParallel`` can cut ``spec``'s model into stages (its forward
    traces with torch.fx: built on fake tensors at the model's depth, nothing compiled), else
    the reason."""
    if spec.kind != "lm" or not spec.layer_prefix or not spec.n_layer or spec.n_layer < 2:
        return f"{spec.name} has no repeated blocks the planner knows to cut into stages"
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchacc.pipeline import stages

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = TokensOnly(spec.build(None, False))
    try:
        stages.Stages(model, [f"model.{spec.layer_prefix}{spec.n_layer // 2}"])
    except ValueError as e:
        return str(e)
    return None


def split_points(spec, n_layer, pp):
    """Stage k starts at block ``k * n_layer / pp`` (``spec.layer_prefix`` + index, inside
    ``TokensOnly``)."""
    prefix = "model." + (spec.layer_prefix or "")
    return [f"{prefix}{n_layer // pp * k}" for k in range(1, pp)]


def build(spec, n_layer, layout, micro, precision, gc, fake=None):
    """The ``PipelineModule`` of ``spec`` at ``n_layer`` layers for ``layout``, built on fake
    tensors (what ``ta.dist.PipelineParallel`` builds from ``Config.dist``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchacc.accel.config import TOPOLOGY
    from torchacc.pipeline import PipelineModule
    from torchacc.plan.models import PlanError

    fake = fake or FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = TokensOnly(spec.build(n_layer, False))
        model.train()
        try:
            pm = PipelineModule(
                model, layout["pp"], split_points(spec, n_layer, layout["pp"]),
                num_micro_batches=micro, schedule="1f1b", fsdp=layout["fsdp"],
                topology=[t for t in TOPOLOGY if t in ("dp", "fsdp", "pp")], dp=layout["dp"],
                autocast=torch.bfloat16 if precision == "bf16" else None,
            )  # fmt: skip
        except ValueError as e:
            raise PlanError(f"{spec.name} with pp={layout['pp']}: {e}") from None
    if gc:
        from torchacc.accel.gc import apply_gc

        blocks = model.model.get_submodule((spec.layer_prefix or "").rstrip("."))
        apply_gc(model, {type(blocks[0]).__name__})
    return pm, model, fake


def compile_pp(spec, req, layout, n_layer, devices):
    """Trace and compile one pipelined step (Note [What the planner compiles under pp]); the
    raw measurements ``_worker.compile_one`` returns."""
    import jax
    import numpy as np

    from torchacc.lazy import device as lazy_device
    from torchacc.lowering.dtypes import jdtype
    from torchacc.plan import compile as pc

    t0 = time.perf_counter()
    L = n_layer or spec.n_layer
    M = req["microbatches"]
    pm, model, fake = build(spec, L, layout, M, req["precision"], req["gc"])
    dev = lazy_device.device()
    B, T = req["batch_size"], req["seq_len"]
    with fake:
        ids = torch.empty(B, T, dtype=torch.long, device=dev)
        labels = torch.empty(B, T, dtype=torch.long, device=dev)
    inputs, out_kwargs = pm._bind((ids,), {"labels": labels}, lm_loss)
    named = [*inputs.items(), *out_kwargs.items()]
    nb = pm._check_batch(named)
    autocast = torch.bfloat16 if req["precision"] == "bf16" else None
    call, _rng = pm._build(named, len(inputs), nb, lm_loss, autocast, True)
    t_trace = time.perf_counter() - t0
    mesh = pm.mesh()
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    _, param_axis = pm._axes()
    packed, shared, consts = pm._packed(), pm._shared(), pm._consts()
    n_p, n_s, n_c = len(packed), len(shared), len(consts)

    def sh_of(k, t):
        if k < n_p:
            return NS(mesh, P(pm.axis, param_axis))
        return NS(mesh, P(*([None] * t.dim())))

    params = [jax.ShapeDtypeStruct(tuple(t.shape), jdtype(t.dtype), sharding=sh_of(k, t))
              for k, t in enumerate([*packed, *shared, *consts])]  # fmt: skip
    p_sh = [a.sharding for a in params[: n_p + n_s]]
    adam = req["optimizer"] == "adamw"
    states = [jax.ShapeDtypeStruct(a.shape, jax.numpy.float32, sharding=a.sharding)
              for a in params[: n_p + n_s]] * (2 if adam else 1)  # fmt: skip
    rep = NS(mesh, P())
    count = jax.ShapeDtypeStruct((), jax.numpy.float32, sharding=rep)
    data = [jax.ShapeDtypeStruct((B, T), jdtype(torch.long), sharding=rep)] * 2
    n_t = n_p + n_s
    n_st = len(states)

    def step(*arrays):
        ps = list(arrays[:n_t])
        cs = list(arrays[n_t : n_t + n_c])
        st = list(arrays[n_t + n_c : n_t + n_c + n_st])
        t = arrays[n_t + n_c + n_st]
        xs = list(arrays[n_t + n_c + n_st + 1 :])
        loss, *grads = call([*ps, *cs, *xs])
        t = t + 1
        lr, wd = 1e-4, 0.1
        new_p, new_s = [], [None] * n_st
        for i, (p, g) in enumerate(zip(ps, grads)):
            g = g.astype(jax.numpy.float32)
            if adam:
                m = st[i] * 0.9 + g * 0.1
                v = st[n_t + i] * 0.95 + g * g * 0.05
                upd = (m / (1 - 0.9**t)) / (jax.numpy.sqrt(v / (1 - 0.95**t)) + 1e-8)
                new_p.append((p * (1 - lr * wd) - lr * upd).astype(p.dtype))
                new_s[i], new_s[n_t + i] = m, v
            else:
                m = st[i] * 0.9 + g
                new_p.append((p - lr * m).astype(p.dtype))
                new_s[i] = m
        return [loss, *new_p, *new_s, t, *grads]

    avals = [*params[:n_t], *params[n_t:], *states, count, *data]
    in_sh = [a.sharding for a in avals]
    out_sh = [rep, *p_sh, *[s.sharding for s in states], rep, *p_sh]
    donate = tuple(range(n_t)) + tuple(range(n_t + n_c, n_t + n_c + n_st + 1))
    t1 = time.perf_counter()
    exe = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
    exe = exe.lower(*avals).compile()
    t_compile = time.perf_counter() - t1
    mem = exe.memory_analysis()
    cost = exe.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    hlo = exe.as_text()
    if os.environ.get("TORCHACC_PLAN_DUMP_HLO"):
        with open(os.environ["TORCHACC_PLAN_DUMP_HLO"] + f".pp{L}.hlo.txt", "w") as f:
            f.write(hlo)
    # Note [FLOPs of the pipelined step]
    ticks = max([int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)] or [1])
    ids_grid = np.vectorize(lambda d: d.id)(mesh.devices)
    colls = pc.collectives(hlo, ids_grid, tuple(mesh.axis_names))
    shape = dict(mesh.shape)

    def per_device(a, itemsize=None):
        spec_ = tuple(a.sharding.spec) + (None,) * (len(a.shape) - len(a.sharding.spec))
        k = math.prod(shape[e] for e in spec_ if e is not None)
        return math.prod(a.shape) // k * (itemsize or a.dtype.itemsize)

    param_bytes = sum(per_device(a) for a in params[:n_t])
    grad_bytes = param_bytes  # gradients in the parameter's dtype and layout
    opt_bytes = sum(per_device(a) for a in states)
    # activations kept: 1F1B stashes at most min(M, 2S - 1) stage inputs per device
    S = layout["pp"]
    bnd = max(
        (sum(math.prod(s) * np.dtype(d).itemsize for s, d in b) for b in pm.plan.boundaries),
        default=0,
    )
    act = bnd * min(M, 2 * S - 1)  # (boundaries are per device: one micro-batch shard)
    n_params = sum(p.numel() for p in model.parameters())
    return dict(
        n_layer=L, trace_s=t_trace, compile_s=t_compile,
        argument=int(mem.argument_size_in_bytes), output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes), temp=int(mem.temp_size_in_bytes),
        generated_code=int(mem.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)) * ticks,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) * ticks, schedule_ticks=ticks,
        collectives=colls, params=param_bytes, grads=grad_bytes, optimizer=opt_bytes,
        buffers=sum(per_device(a) for a in params[n_t:]), batch=sum(per_device(a) for a in data),
        activations=int(act), n_params=n_params, embed_params=pc._embedding_params(model),
        param_elems_padded=sum(math.prod(a.shape) for a in params[:n_t]),
        graph_nodes=0, whole_step=True, mesh_axes=list(mesh.axis_names),
    )  # fmt: skip
