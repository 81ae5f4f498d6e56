"""Compiling one abstract training step for a mesh of virtual devices, and reading what XLA says.

Runs inside the planner's worker process (``torchacc/plan/_worker.py``), whose JAX was started
with ``--xla_force_host_platform_device_count=N``. Note [What the planner compiles]:

1. the model is built under ``FakeTensorMode`` (no weight is allocated);
2. one training step -- forward (under ``torch.autocast`` bf16 for ``precision="bf16"``, fp32
   master weights), cross-entropy loss, ``torch.autograd.grad``, and the optimizer update written
   functionally (AdamW: two fp32 moments and a step count; SGD with momentum: one buffer) -- is
   traced with ``make_fx`` and functionalized, as ``torchacc.compile_step`` traces a step;
3. the graph is lowered with torchacc's rules (``dynamo/lower.py``) into one JAX function;
   BatchNorm's running statistics become results of the step (Note [Buffer updates]);
4. that function is ``jax.jit``-ed with the layout's shardings (parameters, gradients and
   optimizer state in the parameter's layout, the batch over the data axes), parameters and
   optimizer state donated (updated in place, as a real step does), and compiled from
   ``jax.ShapeDtypeStruct`` s only. A dimension a mesh axis does not divide is padded, as the
   sharding engine pads it (Note [Padded shards] in sharding/layout.py).

Note [Tracing on the torchacc device]
The fake model, its batch and its optimizer state live on the torchacc device (fake tensors of
device ``torchacc``), and AMP is ``torch.autocast("torchacc")``. So the step takes the same
layers a real run takes: ``F.linear`` and SDPA reach the autograd-level kernels
(lazy/autograd_kernels.py) and ``torchacc_ops`` (RMSNorm, rotary, SwiGLU, attention with
grouped-query heads unexpanded) their fused kernels (lazy/fused_kernels.py), one op forward and
one backward each. Traced on the CPU instead, those layers decomposed into PyTorch's math (the
attention's key/value heads repeated, every intermediate saved for the backward): another
program, whose XLA temp was 12% above a real LLaMA-tiny FSDP step's (tests/test_plan.py).

Note [Context parallel in a plan]
With cp > 1 the planned step is the one ``ta.accelerate`` runs for ``Config.dist.sp``: the fake
model is wrapped by ``context_parallel.model.parallelize`` over the plan mesh's ``cp`` axis, so
its attention calls trace into the ring / Ulysses region (a ``shard_map`` with all-to-all or
ppermute; "auto" picks as dist.sp does), the token ids and labels lie (data axes, cp), and, as
dist.sp constrains only the model's inputs, no activation gets a sharding constraint (Note
[Activation layout] is the dp / fsdp front doors'); XLA's partitioner carries the sequence split
through every per-token layer.

The compiled executable's ``memory_analysis()``, ``cost_analysis()`` and HLO text are per device
(XLA's SPMD partitioner has already split the program).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "lm_head")
ROW = ("o_proj", "down_proj", "c_proj")
DATA_AXES = ("dp", "fsdp")
AXES = ("dp", "fsdp", "cp", "tp")  # the mesh of one pipeline stage, tp innermost


def param_spec(name, shape, mesh_shape):
    """Partition spec of parameter ``name`` of ``shape`` under the layout (Note [Layouts] in
    torchacc/plan/__init__.py): tp Megatron column/row pairs, fsdp dim 0 (the sharding engine's
    FSDP choice, ``distributed/fsdp.py``) or, where tp took dim 0, dim 1."""
    nd = len(shape)
    spec = [None] * nd
    tp, fsdp = mesh_shape.get("tp", 1), mesh_shape.get("fsdp", 1)
    leaf = name.rsplit(".", 2)
    module = leaf[-2] if len(leaf) >= 2 else ""
    if tp > 1 and nd >= 1:
        if module in COLUMN or (module in ("embed", "wte") and nd == 2):
            spec[0] = "tp"
        elif module in ROW and nd == 2:
            spec[1] = "tp"
    if fsdp > 1 and nd >= 1:
        free = [d for d in range(nd) if spec[d] is None]
        if free:
            spec[free[0]] = "fsdp"
    return tuple(spec)


def padded(shape, spec, mesh_shape):
    out = []
    for n, e in zip(shape, spec):
        k = (
            1
            if e is None
            else math.prod(mesh_shape[a] for a in (e if isinstance(e, tuple) else (e,)))
        )
        out.append(-(-n // k) * k)
    return tuple(out)


def shard_bytes(shape, spec, mesh_shape, itemsize):
    """Bytes of one device's shard of a tensor (padding included)."""
    p = padded(shape, spec, mesh_shape)
    k = 1
    for e in spec:
        if e is not None:
            k *= math.prod(mesh_shape[a] for a in (e if isinstance(e, tuple) else (e,)))
    return math.prod(p) // k * itemsize


def count_params(spec):
    """(parameters, input-embedding parameters) of the whole model, built on fake tensors."""
    model, _ = _build(spec, None, False, False)
    return sum(p.numel() for p in model.parameters()), _embedding_params(model)


def _build(spec, n_layer, scan_layers, gc):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, _device():  # Note [Tracing on the torchacc device]
        model = spec.build(n_layer, False)  # scan_layers: Note [scan_layers in a plan]
    model.train()
    if gc:
        _checkpoint_blocks(model, spec)
    return model, fake


def _checkpoint_blocks(model, spec):
    """Gradient checkpointing: each repeated block recomputed in the backward."""
    import torch.utils.checkpoint as cp

    prefix = (spec.layer_prefix or "").rstrip(".")
    blocks = model.get_submodule(prefix) if prefix else None
    if not isinstance(blocks, torch.nn.ModuleList):
        return
    for b in blocks:
        fwd = b.forward

        def run(*a, _f=fwd, **k):
            return cp.checkpoint(_f, *a, use_reentrant=False, preserve_rng_state=False, **k)

        b.forward = run


def _device():
    from torchacc.lazy import device

    return device.device()


def make_batch(spec, fake, batch, seq):
    d = _device()
    with fake:
        if spec.kind == "vision":
            c, h, w = spec.image
            return [
                torch.empty(batch, c, h, w, device=d),
                torch.empty(batch, dtype=torch.long, device=d),
            ]
        return [
            torch.empty(batch, seq, dtype=torch.long, device=d),
            torch.empty(batch, seq, dtype=torch.long, device=d),
        ]


def trace(spec, *, n_layer, batch, seq, precision, optimizer, gc, scan_layers, cp=None):
    """The functionalized FX graph of one training step and the roles of its inputs/outputs.
    ``cp``: ``(mesh, batch_axes, head_axis)`` for context parallel (Note [Context parallel in
    a plan])."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.utils import stateless

    from torchacc.dynamo.aot import decompositions

    model, fake = _build(spec, n_layer, scan_layers, gc)
    if cp is not None:
        from torchacc.context_parallel import model as cp_model

        mesh, batch_axes, head_axis = cp
        cp_model.parallelize(model, mesh, "cp", batch_axes, head_axis, "auto", "plan cp")
    named = list(model.named_parameters())  # tied weights once
    names = [n for n, _ in named]
    params = [p for _, p in named]
    buffers = dict(model.named_buffers())
    d = _device()
    with fake:
        m = [torch.empty(p.shape, dtype=torch.float32, device=d) for p in params]
        v = (
            [torch.empty(p.shape, dtype=torch.float32, device=d) for p in params]
            if optimizer == "adamw"
            else []
        )
        count = torch.empty((), dtype=torch.float32, device=d)
    data = make_batch(spec, fake, batch, seq)
    n_p, n_m, n_v, n_b = len(params), len(m), len(v), len(buffers)
    bnames = list(buffers)
    amp = precision in ("bf16", "bfloat16")

    def step(*flat):
        ps = list(flat[:n_p])
        ms = list(flat[n_p : n_p + n_m])
        vs = list(flat[n_p + n_m : n_p + n_m + n_v])
        t = flat[n_p + n_m + n_v]
        bufs = flat[n_p + n_m + n_v + 1 : n_p + n_m + n_v + 1 + n_b]
        x, y = flat[n_p + n_m + n_v + 1 + n_b :]
        ps = [p.detach().requires_grad_(True) for p in ps]
        state = {**dict(zip(names, ps)), **dict(zip(bnames, bufs))}
        # the substitution spans the backward too: gc's recompute reads the module's weights
        with stateless._reparametrize_module(model, state, tie_weights=True):
            with torch.autocast(d.type, dtype=torch.bfloat16, enabled=amp):
                out = model(x)
            out = out.float()
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            grads = torch.autograd.grad(loss, ps)
        new_p, new_m, new_v = [], [], []
        t = t + 1
        lr, wd = 1e-4, 0.1
        if optimizer == "adamw":
            b1, b2, eps = 0.9, 0.95, 1e-8
            c1 = 1 - torch.pow(b1, t)
            c2 = 1 - torch.pow(b2, t)
            for p, g, mm, vv in zip(ps, grads, ms, vs):
                mm = mm * b1 + g * (1 - b1)
                vv = vv * b2 + g * g * (1 - b2)
                upd = (mm / c1) / (torch.sqrt(vv / c2) + eps)
                new_p.append(p.detach() * (1 - lr * wd) - lr * upd)
                new_m.append(mm)
                new_v.append(vv)
        else:  # sgd with momentum
            for p, g, mm in zip(ps, grads, ms):
                mm = mm * 0.9 + g
                new_p.append(p.detach() - lr * mm)
                new_m.append(mm)
        return [loss.detach(), *new_p, *new_m, *new_v, t, *[g.detach() for g in grads]]

    example = [*params, *m, *v, count, *buffers.values(), *data]
    example = [e.detach() for e in example]
    decomp = decompositions()
    with fake:
        raw = make_fx(step, decomposition_table=decomp)(*example)
        gm = make_fx(
            torch.func.functionalize(raw, remove="mutations_and_views"),
            decomposition_table=decomp,
        )(*example)
    written = _buffer_updates(gm, n_p + n_m + n_v + 1, n_b)
    roles_in = (
        [("param", i) for i in range(n_p)]
        + [("m", i) for i in range(n_m)]
        + [("v", i) for i in range(n_v)]
        + [("count", 0)]
        + [("buffer", i) for i in range(n_b)]
        + [("batch", i) for i in range(len(data))]
    )
    roles_out = (
        [("loss", 0)]
        + [("param", i) for i in range(n_p)]
        + [("m", i) for i in range(n_m)]
        + [("v", i) for i in range(n_v)]
        + [("count", 0)]
        + [("grad", i) for i in range(n_p)]
        + [("buffer", i) for i in written]
    )
    info = dict(
        names=names,
        shapes=[tuple(p.shape) for p in params],
        dtypes=[p.dtype for p in params],
        buffers=[(tuple(b.shape), b.dtype) for b in buffers.values()],
        data=[(tuple(d.shape), d.dtype) for d in data],
        n_params=sum(p.numel() for p in params),
        embed_params=_embedding_params(model),
    )
    return gm, roles_in, roles_out, info


def _buffer_updates(gm, first, n_buffers):
    """Note [Buffer updates]: functionalization writes each mutated input back with a trailing
    ``copy_`` (BatchNorm's running statistics and batch count); the planner makes every buffer's
    new value a result of the step instead (donated with the buffer, as a real step's program
    updates it in place). Buffers are placeholders ``first .. first + n_buffers - 1``; returns
    the indices of those written."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    buffers = phs[first : first + n_buffers]
    new = dict.fromkeys(buffers)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            if n.args[0] in new and not n.users:
                new[n.args[0]] = n.args[1]
                gm.graph.erase_node(n)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    written = [i for i, b in enumerate(buffers) if new[b] is not None]
    out.args = (list(out.args[0]) + [new[buffers[i]] for i in written],)
    gm.graph.lint()
    gm.recompile()
    return written


def _embedding_params(model):
    """Input-embedding table elements not shared with a Linear (excluded from 6N)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear
    )


def saved_activation_nodes(gm):
    """Forward values the backward reads: produced before the first backward node, used after.
    The backward starts where the loss's gradient seed is made (the first ``ones_like``/``full``
    after the loss, or the first node reading the loss's value)."""
    nodes = [n for n in gm.graph.nodes]
    boundary = None
    for i, n in enumerate(nodes):
        if n.op == "call_function" and "nll_loss_backward" in str(n.target):
            boundary = i
            break
    if boundary is None:
        return []
    order = {n: i for i, n in enumerate(nodes)}
    saved = []
    for n in nodes[:boundary]:
        if n.op != "call_function":
            continue
        if any(order[u] > boundary for u in n.users):
            saved.append(n)
    return saved


def lower_to_jax(gm, constrain=None):
    """The graph as one JAX function ``f(*inputs) -> outputs`` (positions of the graph's
    placeholders and outputs); a :class:`PlanError` names any op without a lowering.
    ``constrain(node, array) -> array``: applied to every node's result (sharding constraints
    on activations, Note [Activation layout])."""
    from torch import fx

    from torchacc.dynamo import lower
    from torchacc.lowering.fx_calling import _eval_python, eval_rule
    from torchacc.plan.models import PlanError

    low = lower.Lowered(gm, name="plan")
    if low.fallback_ops or len(low.pieces) != 1:
        raise PlanError(
            "the step has ops without a torchacc lowering (they would run eagerly between "
            f"programs, which the planner cannot size): {sorted(set(low.fallback_ops))}"
        )
    piece = low.pieces[0]
    seg, consts = piece.seg, piece.consts
    placeholders = low.placeholders
    pos = {n: i for i, n in enumerate(placeholders)}
    in_idx = [pos[n] for n in seg.inputs]
    outs = low.outs
    out_pos = {n: i for i, n in enumerate(seg.outputs)}

    def fn(*arrays):  # JaxPiece.function's loop, with the constraint hook
        env = dict(consts)
        for n, i in zip(seg.inputs, in_idx):
            env[n] = arrays[i]
        keys = [None]
        for node in seg.nodes:
            rule = lower._rule_of(node)
            if rule is None:
                env[node] = _eval_python(node, env)
                continue
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            val = eval_rule(node, rule, args, kwargs, keys)
            env[node] = constrain(node, val) if constrain is not None else val
        return [env[n] for n in seg.outputs]

    if piece.rng:
        raise PlanError("the step draws random numbers (dropout > 0?): plan it with dropout 0")

    def run(*arrays):
        res = fn(*arrays)
        vals = []
        for o in outs:
            if o in out_pos:
                vals.append(res[out_pos[o]])
            elif o in pos:
                vals.append(arrays[pos[o]])
            else:
                raise PlanError(f"the step's output {o} is neither computed nor an input")
        return vals

    return run, len(placeholders)


def activation_constraint(mesh, data_axes, mesh_shape, batch, seq):
    """Note [Activation layout]: every activation whose dim 0 is the batch stays split over the
    data axes (and dim 1, the sequence, over cp), as torchacc's FSDP front doors constrain each
    wrapped module's inputs and outputs (``distributed/fsdp.py`` ``shard_batch``); the other
    dimensions are left to XLA."""
    import jax

    P = jax.sharding.PartitionSpec
    U = P.UNCONSTRAINED
    cp = mesh_shape["cp"] > 1

    def constrain(node, val):
        if not isinstance(val, jax.Array) and not hasattr(val, "aval"):
            return val
        shape = getattr(val, "shape", ())
        if len(shape) < 2 or shape[0] != batch:
            return val
        spec = [data_axes] + [U] * (len(shape) - 1)
        if cp and shape[1] == seq:
            spec[1] = "cp"
        sh = jax.sharding.NamedSharding(mesh, P(*spec))
        return jax.lax.with_sharding_constraint(val, sh)

    return constrain


# -- HLO collectives ----------------------------------------------------------------------------

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<rest>.*)$")
_DT = {
    "f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "s8": 1,
    "u8": 1, "pred": 1, "s16": 2, "u16": 2,
}  # fmt: skip


def _shape_bytes(text):
    total = 0
    for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dt in _DT:
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            total += n * _DT[dt]
    return total


def _balanced(text, start):
    """End index (exclusive) of the bracketed group opening at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def _parse_instruction(line):
    """(result shape text, op, operands text, attributes text) of an HLO collective line."""
    m = _OP_RE.match(line)
    if not m:
        return None
    rest = m.group("rest")
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, tail = rest[:end], rest[end:].lstrip()
    for op in _OPS:
        for name in (op, op + "-start"):
            if tail.startswith(name + "("):
                close = _balanced(tail, len(name))
                return shape, name, tail[len(name) + 1 : close - 1], tail[close:]
    return None


def _groups(args, n_devices):
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:T\(([\d,]+)\))?\s*\{([^}]*)\}", args)
    if m:  # XLA's mesh form: mesh['a'=2,'b'=2] {'b'}: devices varying along the named axes
        dims = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [d[0] for d in dims]
        ids = np.arange(math.prod(int(d[1]) for d in dims)).reshape([int(d[1]) for d in dims])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        chosen = [names.index(x) for x in re.findall(r"'([^']+)'", m.group(3))]
        rest = [i for i in range(len(names)) if i not in chosen]
        ids = ids.transpose(rest + chosen)
        size = math.prod(ids.shape[len(rest) :]) if chosen else 1
        return ids.reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", args)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", args)
    if m:
        return [
            [int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"source_target_pairs=\{([\d,{} ]*)\}", args)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return [list(range(n_devices))]


def collectives(hlo_text, device_grid, axis_names):
    """[(op, bytes per device, axes)] of every collective in the (partitioned) HLO module.
    ``device_grid``: the mesh's device ids (ndarray shaped like the mesh). Bytes: the op's result
    (all-reduce, all-gather, all-to-all, collective-permute) or operand (reduce-scatter) per
    device; ``axes``: the mesh axes along which its replica group's devices differ."""
    coords = {int(d): np.argwhere(device_grid == d)[0] for d in device_grid.flat}
    out = []
    for line in hlo_text.splitlines():
        if not any(op in line for op in _OPS):
            continue
        parsed = _parse_instruction(line)
        if parsed is None:
            continue
        shape, op, operands, attrs = parsed
        start = op.endswith("-start")
        op = op.removesuffix("-start")
        if op == "reduce-scatter":
            nbytes = _shape_bytes(operands)  # the operand (its result is 1/n of it)
        elif start and shape.startswith("("):
            # async start: (operands, results[, contexts]); the results are the second part
            parts = _split_tuple(shape)
            nbytes = _shape_bytes(parts[1] if len(parts) > 1 else parts[0])
        else:
            nbytes = _shape_bytes(shape)
        groups = _groups(attrs, len(coords))
        grp = groups[0]
        varying = set()
        for d in grp[1:]:
            diff = coords[d] != coords[grp[0]]
            varying.update(int(i) for i in np.nonzero(diff)[0])
        if op == "collective-permute":
            for a, b in groups:
                diff = coords[b] != coords[a]
                varying.update(int(i) for i in np.nonzero(diff)[0])
        axes = tuple(axis_names[i] for i in sorted(varying))
        if not axes:
            continue
        out.append((op, nbytes, axes, len(grp)))
    return out


def _split_tuple(shape):
    inner = shape.strip()[1:-1]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts
