"""The sharding engine's recipes: parallelism policies written as shardings of a model's
parameters (and, for sequence parallelism, of activations), for the front doors to apply.
``tensor_parallel``: Megatron's column->row pairs (Note [Megatron pairs]); ``parallelize_module``:
torch's ``torch.distributed.tensor.parallel`` plans (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``) translated into the same shardings. XLA's partitioner inserts every
collective."""

from __future__ import annotations

import torch

from torchacc.sharding import api as sharding

__all__ = [
    "megatron_plan",
    "tensor_parallel",
    "parallelize_module",
    "torch_style_hook",
    "torch_style_replicates",
    "distribute_module",
]

# Note [Megatron pairs]
# ~~~~~~~~~~~~~~~~~~~~~
# Megatron tensor parallelism splits a block's first Linear by columns (its output features:
# weight dim 0) and the Linear that consumes them by rows (its input features: weight dim 1).
# Between the two, every device holds its slice of the features (its heads, its part of the
# MLP's hidden units) and computes on it alone; the row layer's products are partial sums, and
# the one collective is the all-reduce of its output (b*s*h values) -- in the forward, one per
# attention and one per MLP; in the backward the same two, on the column layers' input
# gradients. Nothing here inserts a collective: the parameters carry the shardings and XLA's
# partitioner derives the all-reduces from them.
#
# Pairs are found by the layer names of the gallery's (and Hugging Face's) LLaMA and GPT-2:
#   attention  q_proj, k_proj, v_proj -> o_proj   |  c_attn (fused QKV, head-major) -> c_proj
#   MLP        gate_proj, up_proj -> down_proj    |  c_fc -> c_proj
# and, in any other module, two of its own Linear children registered one after the other whose
# sizes chain (a.out_features == b.in_features). Every Linear left over, embeddings and norms
# stay whole on the tp axis. tp must divide the attention heads, the key/value heads of
# grouped-query attention (as Megatron asks of its query groups) and the MLP's hidden size: a
# ValueError names the sizes before anything is sharded.

COLUMN, ROW = "colwise", "rowwise"


def _linear(m, name):
    sub = getattr(m, name, None)
    return sub if isinstance(sub, torch.nn.Linear) else None


def _check(cond, what, sizes, tp):
    if not cond:
        raise ValueError(f"dist.tp: tp size {tp} does not divide {what} ({sizes})")


def megatron_plan(model, tp):
    """``{qualified Linear name: "colwise" | "rowwise"}`` of ``model``'s Megatron pairs for
    ``tp`` devices (Note [Megatron pairs]); checks every size first (one ValueError naming the
    sizes) and changes nothing."""
    plan, taken = {}, set()

    def put(prefix, m, name, style):
        layer = _linear(m, name)
        plan[f"{prefix}{name}"] = style
        taken.add(id(layer))

    for path, m in model.named_modules():
        prefix = f"{path}." if path else ""
        if all(_linear(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            heads = getattr(m, "n_head", getattr(m, "num_heads", None))
            kv = getattr(m, "n_kv_head", getattr(m, "num_key_value_heads", heads))
            if heads is not None:
                _check(heads % tp == 0, "the attention heads", f"{path}: {heads} heads", tp)
            _check(m.o_proj.in_features % tp == 0, "the attention width", path, tp)
            if kv is not None:
                _check(kv % tp == 0, "the key/value heads", f"{path}: {kv} key/value heads", tp)
            for n in ("q_proj", "k_proj", "v_proj"):
                put(prefix, m, n, COLUMN)
            put(prefix, m, "o_proj", ROW)
        elif _linear(m, "c_attn") and _linear(m, "c_proj"):
            heads = getattr(m, "n_head", None)
            if heads is None:
                raise ValueError(
                    f"dist.tp: {path}: a fused c_attn without n_head; the heads are unknown"
                )
            _check(heads % tp == 0, "the attention heads", f"{path}: {heads} heads", tp)
            put(prefix, m, "c_attn", COLUMN)
            put(prefix, m, "c_proj", ROW)
        elif all(_linear(m, n) for n in ("gate_proj", "up_proj", "down_proj")):
            hidden = m.down_proj.in_features
            _check(hidden % tp == 0, "the MLP hidden size", f"{path}: {hidden}", tp)
            put(prefix, m, "gate_proj", COLUMN)
            put(prefix, m, "up_proj", COLUMN)
            put(prefix, m, "down_proj", ROW)
        elif _linear(m, "c_fc") and _linear(m, "c_proj"):
            hidden = m.c_fc.out_features
            _check(hidden % tp == 0, "the MLP hidden size", f"{path}: {hidden}", tp)
            put(prefix, m, "c_fc", COLUMN)
            put(prefix, m, "c_proj", ROW)
    for path, m in model.named_modules():  # any other module: its chained Linear children
        prefix = f"{path}." if path else ""
        children = [(n, c) for n, c in m.named_children() if isinstance(c, torch.nn.Linear)]
        for (na, a), (nb, b) in zip(children, children[1:]):
            if id(a) in taken or id(b) in taken or a.out_features != b.in_features:
                continue
            if a.out_features % tp == 0:
                put(prefix, m, na, COLUMN)
                put(prefix, m, nb, ROW)
    if not plan:
        raise ValueError(
            f"dist.tp: tp size {tp}: {type(model).__name__} has no column->row Linear pair "
            "(attention q/k/v->o_proj or c_attn->c_proj, MLP gate/up->down_proj or c_fc->c_proj, "
            "or two chained Linear children of one module); use parallelize_module with a plan"
        )
    return plan


def _shard_linear(layer, style, mesh, tp_axis, fsdp_axis, call):
    w = layer.weight
    spec = (tp_axis, fsdp_axis) if style == COLUMN else (fsdp_axis, tp_axis)
    sharding.mark(w, sharding.named_sharding(mesh, spec, tuple(w.shape), call), call)
    if layer.bias is not None:
        b = layer.bias
        spec = (tp_axis,) if style == COLUMN else (None,)
        sharding.mark(b, sharding.named_sharding(mesh, spec, tuple(b.shape), call), call)


def tensor_parallel(model, mesh, tp_axis="tp", fsdp_axis=None, call="dist.tp", plan=None):
    """Megatron tensor parallelism over ``mesh``'s ``tp_axis`` (Note [Megatron pairs]): column
    layers' weight dim 0 over ``tp_axis`` (dim 1 over ``fsdp_axis``; None: replicated), row
    layers' weight dim 1 over ``tp_axis`` (dim 0 over ``fsdp_axis``). ``plan``: the result of
    :func:`megatron_plan` (computed here when None). The parameters must be on the torchacc
    device in SPMD mode. Returns the plan."""
    if plan is None:
        plan = megatron_plan(model, dict(mesh.shape)[tp_axis])
    for name, style in plan.items():
        _shard_linear(model.get_submodule(name), style, mesh, tp_axis, fsdp_axis, call)
    return plan


# torch.distributed.tensor.parallel plans ------------------------------------------------------


def _jax_mesh(mesh, call):
    """The JAX mesh of ``mesh``: a torch_xla ``Mesh`` (``xs.Mesh``) or a JAX ``Mesh``."""
    import jax

    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    if hasattr(mesh, "get_jax_mesh"):
        return mesh.get_jax_mesh()
    raise TypeError(
        f"{call}: expects a torch_xla Mesh (xs.Mesh) or a JAX Mesh of the torchacc devices, got "
        f"{type(mesh).__name__}"
    )


def _placement_dim(placements, call):
    """The tensor dim a DTensor placement (or a 1-tuple of one) shards, None if replicated."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placements, (tuple, list)):
        if len(placements) != 1:
            raise ValueError(f"{call}: a 1-D tp mesh takes one placement, got {placements}")
        placements = placements[0]
    if placements is None or isinstance(placements, Replicate):
        return None
    if isinstance(placements, Shard):
        return placements.dim
    raise ValueError(f"{call}: placement {placements} is not supported (Shard or Replicate)")


def _constrain(t, dim, mesh, axis):
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    spec = [None] * t.dim()
    if dim is not None:
        spec[dim % t.dim()] = axis
    return sharding.mark_spec(t, mesh, spec, "tp layout")


def _hooks(module, in_dim, out_dim, mesh, axis):
    if in_dim is not None:

        def pre(mod, args):
            return (_constrain(args[0], in_dim, mesh, axis), *args[1:])

        module.register_forward_pre_hook(pre)
    if out_dim is not None:
        module.register_forward_hook(lambda mod, args, out: _constrain(out, out_dim, mesh, axis))


def torch_style_hook(fn, call="distribute_module"):
    """The tensor dim a ``torch.distributed.tensor.parallel`` style's input / output hook lays
    its tensor out on (a ``functools.partial`` of ``_prepare_input_fn`` / ``_prepare_output_fn``
    over the layouts, as ``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel`` pass
    them to ``distribute_module``): ``("dim", d or None)``. ``None`` when ``fn`` is not such a
    hook (a user's own function); a hook of another style is a ValueError naming it."""
    import functools

    if not isinstance(fn, functools.partial):
        return None
    inner = getattr(fn.func, "__func__", fn.func)
    module = getattr(inner, "__module__", "") or ""
    owner, _, name = (getattr(inner, "__qualname__", "") or "").rpartition(".")
    if not module.startswith("torch.distributed.tensor.parallel"):
        return None
    if owner not in ("ColwiseParallel", "RowwiseParallel", "SequenceParallel") or name not in (
        "_prepare_input_fn",
        "_prepare_output_fn",
    ):
        raise ValueError(
            f"{call}: {owner or inner.__qualname__} is not supported (ColwiseParallel, "
            "RowwiseParallel, SequenceParallel)"
        )
    layout = fn.args[0] if fn.args else None
    if isinstance(layout, bool):  # SequenceParallel's output hook: use_local_output only
        return ("dim", None)
    return ("dim", _placement_dim(layout, call))


def torch_style_replicates(partition_fn):
    """Whether ``partition_fn`` is ``SequenceParallel``'s, which replicates the parameters with
    ``DTensor.from_local`` (no DTensor exists in SPMD mode: whole parameters are replicated
    already)."""
    inner = getattr(partition_fn, "__func__", partition_fn)
    return getattr(inner, "__qualname__", "") == "SequenceParallel._replicate_module_fn" and (
        getattr(inner, "__module__", "") or ""
    ).startswith("torch.distributed.tensor.parallel")


def distribute_module(
    module, jmesh, partition_fn, input_fn, output_fn, given_mesh, hook_mesh, unwrap, call
):
    """torch's ``distribute_module`` on a module of the torchacc device in SPMD mode (what
    ``parallelize_module`` on an ``xla`` DeviceMesh reaches through torch_xla's
    ``xla_distribute_module``): ``partition_fn(name, sub, given_mesh)`` marks the parameters
    (torch's ``distribute_tensor`` calls; ``unwrap`` gives the tensor a sharded wrapper holds,
    and the module keeps its own, now sharded, parameter instead of the wrapper). The input /
    output hooks of ColwiseParallel, RowwiseParallel and SequenceParallel become sharding
    constraints of the layouts they name over ``jmesh``'s one axis; a user's own hooks are
    called with ``hook_mesh``. SequenceParallel's replicating partition needs nothing."""
    styled = [torch_style_hook(fn, call) for fn in (input_fn, output_fn)]
    if any(s is not None for s in styled) and len(jmesh.axis_names) != 1:
        raise ValueError(
            f"{call}: torch's tensor-parallel styles take a 1-D mesh (device_mesh['tp']), got "
            f"shape {dict(jmesh.shape)}"
        )
    if partition_fn is not None and not torch_style_replicates(partition_fn):
        for name, sub in module.named_modules():
            before = dict(sub._parameters)
            partition_fn(name, sub, given_mesh)
            for pname, p in list(sub._parameters.items()):
                if p is None or unwrap(p) is p:
                    continue
                old = before.get(pname)
                if old is not None and sharding.sharding_of(old) is not None:
                    sub._parameters[pname] = old  # marked in place by distribute_tensor
                else:
                    t = unwrap(p).detach()
                    sub._parameters[pname] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
    if any(s is not None for s in styled):
        a, b = [None if s is None else s[1] for s in styled]
        _hooks(module, a, b, jmesh, jmesh.axis_names[0])
    if input_fn is not None and styled[0] is None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, hook_mesh))
    if output_fn is not None and styled[1] is None:
        module.register_forward_hook(lambda mod, inputs, out: output_fn(mod, out, hook_mesh))
    return module


def _style_of(style, call):
    from torch.distributed.tensor import parallel as tp

    for cls in (tp.ColwiseParallel, tp.RowwiseParallel, tp.SequenceParallel):
        if isinstance(style, cls):
            return cls.__name__
    raise ValueError(
        f"{call}: {type(style).__name__} is not supported (ColwiseParallel, RowwiseParallel, "
        "SequenceParallel)"
    )


def parallelize_module(module, device_mesh, parallelize_plan, call="parallelize_module"):
    """torch's ``parallelize_module(module, mesh, plan)`` on the torchacc device: each
    ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` of ``parallelize_plan``
    (``{module name (fnmatch patterns): style}``, or one style for ``module`` itself) becomes
    the shardings DTensor would give (Linear weights by output / input features, Embedding
    weights by embedding / vocabulary, bias along) on the mesh's one axis, and its
    ``input_layouts`` / ``output_layouts`` sharding constraints on the module's input / output
    (Shard(1): the sequence). Every name and style is checked before anything is sharded.
    ``module`` must be on the torchacc device in SPMD mode."""
    import fnmatch

    mesh = _jax_mesh(device_mesh, call)
    if len(mesh.axis_names) != 1:
        raise ValueError(f"{call}: expects a 1-D tp mesh, got axes {tuple(mesh.axis_names)}")
    axis = mesh.axis_names[0]
    if not isinstance(parallelize_plan, dict):
        parallelize_plan = {"": parallelize_plan}
    work = []
    names = dict(module.named_modules())
    for pattern, style in parallelize_plan.items():
        kind = _style_of(style, call)
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)] if pattern else [""]
        if not hits:
            raise ValueError(f"{call}: plan entry {pattern!r} names no submodule")
        for n in hits:
            m = names[n]
            if kind != "SequenceParallel" and not isinstance(
                m, (torch.nn.Linear, torch.nn.Embedding)
            ):
                raise ValueError(
                    f"{call}: {kind} on {n or type(m).__name__} ({type(m).__name__}): only "
                    "nn.Linear and nn.Embedding"
                )
            work.append((m, kind, style))
    for m, kind, style in work:
        _apply(m, kind, style, mesh, axis, call)
    return module


def _apply(m, kind, style, mesh, axis, call):
    if kind == "SequenceParallel":  # norms, dropout: parameters whole, activations by sequence
        dim = style.sequence_sharding[0].dim if hasattr(style, "sequence_sharding") else 1
        _hooks(m, dim, None if getattr(style, "use_local_output", False) else dim, mesh, axis)
        return
    embedding = isinstance(m, torch.nn.Embedding)
    w_dim = {("ColwiseParallel", False): 0, ("RowwiseParallel", False): 1}.get(
        (kind, embedding), 1 if kind == "ColwiseParallel" else 0
    )
    w = m.weight
    spec = [None, None]
    spec[w_dim] = axis
    sharding.mark(w, sharding.named_sharding(mesh, spec, tuple(w.shape), call), call)
    bias = getattr(m, "bias", None)
    if bias is not None:
        b_spec = (axis,) if kind == "ColwiseParallel" else (None,)
        sharding.mark(bias, sharding.named_sharding(mesh, b_spec, tuple(bias.shape), call), call)
    in_dim = _placement_dim(style.input_layouts, call)
    out_dim = _placement_dim(style.output_layouts, call)
    # Colwise's defaults (Replicate in, Shard(-1) out) and Rowwise's (Shard(-1) in, Replicate
    # out) are what the partitioner derives from the weights anyway; a Shard(1) of the sequence
    # (sequence parallel) becomes a constraint on that activation
    _hooks(m, in_dim, out_dim, mesh, axis)
