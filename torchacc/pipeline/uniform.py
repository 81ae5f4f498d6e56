"""Uniform pipeline stages: a model whose forward is a prologue, ``L`` identical blocks and an
epilogue, its stages ``L / pp`` blocks each, run the same way on every device (no ``lax.switch``)
so that a stage may itself run collectives: Megatron tensor parallel (``tp``) and context
parallel (``sp``) inside the pipeline, and each stage's blocks as one ``lax.scan`` (scan_layers:
compile time flat in depth). Note [Uniform pipeline stages].

Note [Uniform pipeline stages]
    Why: a collective inside one branch of ``lax.switch`` (the heterogeneous stages' runner)
    deadlocks on XLA:CPU, whose rendezvous waits for every device of the program while the
    other stages' devices run another branch (probed, jax 0.10). tp's all-reduces and cp's
    ring / all-to-all must therefore run in code every device executes.

    What: the forward is traced with torch.fx, the split points' class (the block) kept whole;
    the blocks must form one chain ``x = block_i(x)`` (the model's ``for block in blocks``), the
    split points every ``L / pp``-th block. Every device, each tick, runs the prologue (stage
    0's nodes before the first block, e.g. the embeddings) on the micro-batch and keeps it on
    stage 0 only (``where``), then its own ``L / pp`` blocks as a ``lax.scan`` over their
    stacked parameters, then the epilogue (norm, head, loss), whose loss counts on the last
    stage only. Pipeline time is unchanged (the ticks are in lock step: a tick lasts the slowest
    stage's time anyway) but every pp device gathers the prologue and epilogue parameters.

    Parameters: each block parameter is one ``[pp, L / pp, *shape]`` tensor split over ``pp``
    and, for Megatron's column / row pairs (torchacc/sharding/recipes.py), over ``tp`` on its
    feature dim; prologue / epilogue parameters are stored split over pp x tp on dim 0 (whole
    where it does not divide), taken whole by the step's region (an all-gather at its
    boundary) and computed on every device. The
    stage region is manual over pp and the batch axes; tp and sp stay automatic (XLA's
    partitioner) and cp's attention region nests inside it (Note [Nested regions] in
    torchacc/context_parallel/regions.py). The boundary is the block's activation itself (not a
    flat buffer), so its sequence split over sp travels through the ppermute unchanged.

    Limits (jax 0.10): JAX's autodiff of a scan whose body holds a nested shard_map gives the
    residuals shardings that the partitioner refuses; so under sp the blocks of a stage run
    unrolled (not one scan) and only 1F1B runs (its backward is a VJP inside each tick; GPipe
    differentiates the tick scan). fsdp inside the stages is not supported (dp is).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.fx.node import map_arg

from torchacc.lazy import region as traced_regions
from torchacc.lowering import region as ops
from torchacc.lowering.dtypes import jdtype
from torchacc.pipeline import schedules, stages
from torchacc.pipeline.module import PipelineModule, _autocast, _Shape, schedule_name
from torchacc.sharding import api


class Chain:
    """``model``'s forward as prologue nodes, a chain of ``L`` blocks (modules of the split
    points' class) and epilogue nodes, cut into ``size`` stages of ``L / size`` blocks. Every
    check is a ``ValueError`` naming the sizes or the node, before anything changes."""

    def __init__(self, model, names, size):
        self.model, self.names, self.size = model, list(names), size
        classes = {type(model.get_submodule(n)) for n in names}
        if len(classes) != 1:
            raise ValueError(
                "pipeline parallel with tp / sp / scan_layers: the split points must be blocks "
                f"of one class, got {sorted(c.__name__ for c in classes)}"
            )
        cls = classes.pop()
        keep = [n for n, m in model.named_modules() if n and type(m) is cls]
        try:
            graph = stages._Tracer(keep).trace(model)
        except Exception as e:  # noqa: BLE001 -- FX's own errors, named
            raise ValueError(
                f"pipeline parallel: torch.fx cannot trace {type(model).__name__}.forward to "
                f"split it into stages: {type(e).__name__}: {e}"
            ) from e
        blocks = [n for n in graph.nodes if n.op == "call_module" and n.target in set(keep)]
        L = len(blocks)
        if L % size:
            raise ValueError(
                f"pipeline parallel with tp / sp / scan_layers: pp.size={size} does not divide "
                f"the {L} {cls.__name__} blocks of {type(model).__name__}.forward"
            )
        per = L // size
        want = [blocks[k * per].target for k in range(1, size)]
        if want != self.names:
            raise ValueError(
                f"pipeline parallel with tp / sp / scan_layers: {size} stages of {per} "
                f"{cls.__name__} blocks each split before {want}, got split points {self.names}"
            )
        for a, b in zip(blocks, blocks[1:]):
            if b.args != (a,) or b.kwargs or len(a.users) != 1:
                raise ValueError(
                    f"pipeline parallel with tp / sp / scan_layers: the {cls.__name__} blocks "
                    f"must be one chain x = block(x); {b.target} is called with {b.args} "
                    f"{b.kwargs} and {a.target}'s output has {len(a.users)} users"
                )
        first = blocks[0]
        if len(first.args) != 1 or first.kwargs or len(blocks[-1].users) != 1:
            raise ValueError(
                f"pipeline parallel with tp / sp / scan_layers: the first {cls.__name__} block "
                f"takes one tensor (got {first.args}, {first.kwargs}) and the last one's output "
                "is read once"
            )
        order = {n: i for i, n in enumerate(graph.nodes)}
        body = {"placeholder", "get_attr", "output"}
        self.pre = [n for n in graph.nodes if n.op not in body and order[n] < order[first]]
        self.post = [n for n in graph.nodes if n.op not in body and order[n] > order[blocks[-1]]]
        pre = set(self.pre)
        for n in self.post:
            for u in n.all_input_nodes:
                if u in pre:
                    raise ValueError(
                        f"pipeline parallel with tp / sp / scan_layers: {n} after the blocks "
                        f"reads {u}, computed before them (only the blocks' output crosses)"
                    )
        self.graph, self.blocks, self.per, self.cls = graph, blocks, per, cls
        self.inputs = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        self.block_names = [b.target for b in blocks]
        self.block_ids = set()
        for b in blocks:
            for t in [*model.get_submodule(b.target).parameters()]:
                self.block_ids.add(id(t))

    def _env(self, inputs):
        env = {}
        for ph in self.inputs:
            if ph.target in inputs:
                env[ph] = inputs[ph.target]
            elif ph.args:
                env[ph] = ph.args[0]
            else:
                env[ph] = None
        return env

    def _interpret(self, nodes, env):
        model = self.model

        def load(n):
            return stages._attr(model, n.target) if n.op == "get_attr" else env[n]

        for node in nodes:
            args, kwargs = map_arg(node.args, load), map_arg(node.kwargs, load)
            if node.op == "call_function":
                env[node] = node.target(*args, **kwargs)
            elif node.op == "call_method":
                obj, *rest = args
                env[node] = getattr(obj, node.target)(*rest, **kwargs)
            elif node.op == "call_module":
                env[node] = model.get_submodule(node.target)(*args, **kwargs)
            else:
                raise ValueError(f"pipeline parallel: unexpected FX node {node.op} {node}")
        return load

    def prologue(self, inputs):
        env = self._env(inputs)
        load = self._interpret(self.pre, env)
        return load(self.blocks[0].args[0])

    def epilogue(self, x, inputs, output_fn, out_kwargs):
        env = self._env(inputs)
        env[self.blocks[-1]] = x
        load = self._interpret(self.post, env)
        out = map_arg(self.output.args[0], load)
        if output_fn is not None:
            return output_fn(out, **(out_kwargs or {}))
        return stages._loss_of(out)


def _tp_specs(model, chain, tp, axis="tp"):
    """Per block parameter name (relative to the block): its tp PartitionSpec entries (Megatron
    pairs of the first block; every block is of one class)."""
    if tp <= 1:
        return {}
    from torchacc.sharding import recipes

    plan = recipes.megatron_plan(model, tp)  # ValueError naming the sizes
    prefix = chain.block_names[0] + "."
    specs = {}
    for name, style in plan.items():
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix) :]
        col = style == recipes.COLUMN
        specs[f"{rel}.weight"] = (axis, None) if col else (None, axis)
        specs[f"{rel}.bias"] = (axis,) if col else (None,)
    return specs


class UniformPipelineModule(PipelineModule):
    """:class:`PipelineModule` over uniform stages (Note [Uniform pipeline stages]); what
    ``pipeline_parallel`` / ``accelerate`` build when tp, sp or scan_layers is asked for."""

    def __init__(self, model, size, split_points, tp=1, sp=1, sp_algorithm="auto", **kw):
        self._tp_size, self._sp_size, self._sp_algorithm = int(tp), int(sp), sp_algorithm
        if sp > 1 and schedule_name(kw.get("schedule", "1f1b")) != "1f1b":
            raise NotImplementedError(
                f"pipeline parallel with sp.size={sp}: the GPipe schedule differentiates its "
                "tick scan, through which cp's nested attention region does not lower (jax "
                "0.10); use schedule='1F1B'"
            )
        super().__init__(model, size, split_points, **kw)

    def _cut(self, model, names):
        chain = Chain(model, names, self.num_stages)
        self._tp_specs = _tp_specs(model, chain, self._tp_size)
        return chain

    def _pack(self, model):
        chain, S = self._split, self.num_stages
        aliases: dict = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        for name, b in model.named_buffers(remove_duplicate=False):
            aliases.setdefault(id(b), []).append(name)
        self._aliases = aliases
        first = model.get_submodule(chain.block_names[0])
        rel = [n for n, _ in first.named_parameters()]
        self._rel = rel
        mods = [model.get_submodule(n) for n in chain.block_names]
        with torch.no_grad():
            for i, r in enumerate(rel):
                ps = [dict(m.named_parameters())[r] for m in mods]
                t = torch.stack([p.detach() for p in ps]).reshape(S, chain.per, *ps[0].shape)
                self.register_parameter(
                    f"stacked_{i}", torch.nn.Parameter(t.clone(), ps[0].requires_grad)
                )
            shared = [(n, p) for n, p in model.named_parameters() if id(p) not in chain.block_ids]
            self._shared_names = [n for n, _ in shared]
            for i, (_, p) in enumerate(shared):
                self.register_parameter(
                    f"shared_{i}", torch.nn.Parameter(p.detach().clone(), p.requires_grad)
                )
            self._buffer_names = [n for n, _ in model.named_buffers()]
            for i, (_, b) in enumerate(model.named_buffers()):
                self.register_buffer(f"const_{i}", b.detach().clone())
        for m in mods:
            if any(True for _ in m.buffers()):
                raise ValueError(
                    f"pipeline parallel with tp / sp / scan_layers: the {chain.cls.__name__} "
                    "blocks hold buffers; only parameters are stacked"
                )
        self._groups = []  # no packed rows
        self._param_ids = {n: id(p) for n, p in model.named_parameters()}
        self._buffer_ids = {n: id(b) for n, b in model.named_buffers()}

    def _packed(self):
        return [getattr(self, f"stacked_{i}") for i in range(len(self._rel))]

    def unpacked(self, grads=False):
        out = {}
        chain = self._split
        for r, t in zip(self._rel, self._packed()):
            src = t.grad if grads else t
            for j, name in enumerate(chain.block_names):
                k, i = divmod(j, chain.per)
                out[f"{name}.{r}"] = None if src is None else src[k, i]
        for name, p in zip(self._shared_names, self._shared()):
            out[name] = p.grad if grads else p
        return out

    def mesh(self):
        if self._mesh is None:
            api.use_spmd()
            n = api.device_count()
            S, tp, sp = self.num_stages, self._tp_size, self._sp_size
            if self._fsdp > 1:
                raise NotImplementedError(
                    f"pipeline parallel with tp.size={tp} / sp.size={sp}: fsdp.size="
                    f"{self._fsdp} is not supported inside the stages (dp is)"
                )
            if n % (S * tp * sp):
                raise ValueError(
                    f"pipeline parallel: pp.size={S} x sp.size={sp} x tp.size={tp} does not "
                    f"divide the job's {n} devices"
                )
            dp = self._dp or n // (S * tp * sp)
            if dp * S * tp * sp != n:
                raise ValueError(
                    f"pipeline parallel: dp={dp} x pp={S} x sp={sp} x tp={tp} != the job's {n} "
                    "devices"
                )
            size = {"dp": dp, self.axis: S, "sp": sp, "tp": tp}
            self._mesh = api.jax_mesh(range(n), list(size.values()), list(size))
        return self._mesh

    def _spec_of(self, i):
        if dict(self.mesh().shape).get("tp", 1) <= 1:
            return None
        return self._tp_specs.get(self._rel[i])

    def _place(self):
        mesh = self.mesh()
        api.adopt_mesh(mesh)
        for i, p in enumerate(self._packed()):
            spec = self._spec_of(i) or (None,) * (p.dim() - 2)
            api.mark(p, api.named_sharding(mesh, (self.axis, None, *spec), tuple(p.shape), "pp"))
        for t in self._shared():
            spec = self._shared_spec(t)
            api.mark(t, api.named_sharding(mesh, spec, tuple(t.shape), "pipeline"))
        for t in self._consts():
            api.mark(t, api.named_sharding(mesh, (None,) * t.dim(), tuple(t.shape), "pipeline"))
        self._placed = True

    def _shared_spec(self, t):
        """Prologue / epilogue parameters are stored split over pp (and tp) on dim 0 when it
        divides (whole otherwise); the step's region takes them whole (an all-gather at its
        boundary, like fsdp's) and its gradients come back split the same way."""
        shape = dict(self.mesh().shape)
        axes = tuple(a for a in (self.axis, "tp") if shape.get(a, 1) > 1)
        n = math.prod(shape[a] for a in axes)
        if t.dim() == 0 or not axes or t.shape[0] % n:
            return (None,) * t.dim()
        return ((axes if len(axes) > 1 else axes[0]), *([None] * (t.dim() - 1)))

    def _grad_shardings(self):
        mesh = self.mesh()
        return [NamedSharding(mesh, P(*self._shared_spec(t))) for t in self._shared()]

    def param_bytes_per_stage(self):
        """Bytes of the stacked block parameters one device holds (its stage's, its tp
        slice)."""
        shape, total = dict(self.mesh().shape), 0
        for i, p in enumerate(self._packed()):
            split = math.prod(shape[a] for a in (self._spec_of(i) or ()) if a)
            total += p[0].numel() * p.element_size() // split
        return total

    def _attention(self, mesh):
        """The blocks' attention as cp's region over ``sp`` (heads on ``tp``), or nothing."""
        import contextlib

        if dict(mesh.shape).get("sp", 1) <= 1:
            return contextlib.nullcontext
        from torchacc import context_parallel as cp
        from torchacc.context_parallel import model as cp_model

        tp = "tp" if dict(mesh.shape).get("tp", 1) > 1 else None
        batch, _ = self._axes()
        group = cp.ContextParallelGroup(mesh, ("sp",), batch, tp)
        return lambda: cp_model.attention_regions(group, self._sp_algorithm)

    def _build(self, named, n_inputs, nb, output_fn, autocast, train):
        chain, S, M = self._split, self.num_stages, self.num_micro_batches
        model = self._underlay
        model.train(train)
        mesh = self.mesh()
        sizes = dict(mesh.shape)
        data_standins = [
            _Shape((v.shape[0] // (M * nb), *v.shape[1:]), v.dtype)
            for _, v in named
            if isinstance(v, torch.Tensor)
        ]
        statics = {n: v for n, v in named if not isinstance(v, torch.Tensor)}
        names = [n for n, _ in named]
        tensor_names = [n for n, v in named if isinstance(v, torch.Tensor)]
        input_names = set(names[:n_inputs])
        shared = list(zip(self._shared_names, self._shared()))
        consts = list(zip(self._buffer_names, self._consts()))
        n_sh, n_c = len(shared), len(consts)
        first = model.get_submodule(chain.block_names[0])
        attention = self._attention(mesh)

        def bind(flat):
            mapping = {}
            for (name, _), t in zip(shared, flat[:n_sh]):
                for a in self._aliases[self._param_ids[name]]:
                    mapping[a] = t
            for (name, _), t in zip(consts, flat[n_sh : n_sh + n_c]):
                for a in self._aliases[self._buffer_ids[name]]:
                    mapping[a] = t
            data = dict(statics)
            data.update(zip(tensor_names, flat[n_sh + n_c + 1 :]))
            ins = {n: v for n, v in data.items() if n in input_names}
            outk = {n: v for n, v in data.items() if n not in input_names}
            return mapping, ins, outk

        def pre_fn(*flat):
            mapping, ins, _ = bind([*flat[: n_sh + n_c], None, *flat[n_sh + n_c :]])
            with stages.reparametrized(model, mapping), _autocast(autocast), attention():
                return (chain.prologue(ins),)

        def post_fn(*flat):
            mapping, ins, outk = bind(flat)
            with stages.reparametrized(model, mapping), _autocast(autocast), attention():
                return (chain.epilogue(flat[n_sh + n_c], ins, output_fn, outk),)

        rel_shapes = [(tuple(p.shape[2:]), p.dtype) for p in self._packed()]

        def block_fn(*flat):
            mapping = dict(zip(self._rel, flat[: len(self._rel)]))
            with stages.reparametrized(first, mapping), _autocast(autocast), attention():
                return (first(flat[len(self._rel)]),)

        common = [
            *[_Shape(t.shape, t.dtype) for _, t in shared],
            *[_Shape(t.shape, t.dtype) for _, t in consts],
        ]
        with torch.set_grad_enabled(False):
            pre = traced_regions.trace(pre_fn, [*common, *data_standins], "pipeline prologue")
            pre_g = ops.GRAPHS[pre.key]
            (x_shape, x_dtype) = pre_g.out_meta[0]
            x_st = _Shape(x_shape, x_dtype)
            blk = traced_regions.trace(
                block_fn, [*[_Shape(s, d) for s, d in rel_shapes], x_st], "pipeline block"
            )
            blk_g = ops.GRAPHS[blk.key]
            post = traced_regions.trace(
                post_fn, [*common, x_st, *data_standins], "pipeline epilogue"
            )
            post_g = ops.GRAPHS[post.key]
        for t, what in ((pre, "prologue"), (blk, "block"), (post, "epilogue")):
            if t.closures:
                raise ValueError(
                    f"pipeline parallel: the {what} reads {len(t.closures)} torchacc tensor(s) "
                    "that are neither parameters nor buffers of the model; make them buffers"
                )
        if blk_g.out_meta[0] != (x_shape, x_dtype):
            raise ValueError(
                f"pipeline parallel: a {chain.cls.__name__} block maps {x_shape} {x_dtype} to "
                f"{blk_g.out_meta[0]}; a chain of blocks keeps its activation's shape"
            )
        if len(post_g.out_meta) != 1 or post_g.out_meta[0][0] != ():
            raise ValueError(
                "pipeline parallel: the loss (output_fn's result, or the model's) must be one "
                f"0-d tensor, got {[m[0] for m in post_g.out_meta]}"
            )
        rng = pre_g.rng or blk_g.rng or post_g.rng
        batch, _ = self._axes()
        sp = "sp" if sizes.get("sp", 1) > 1 else None
        tp_specs = [self._spec_of(i) for i in range(len(self._rel))]
        buf = (jdtype(x_dtype), tuple(x_shape))
        x_spec = P(None, sp) if sp and len(x_shape) >= 2 and x_shape[1] % sizes["sp"] == 0 else P()
        per = chain.per

        def runner(plan):
            manual = schedules._manual(plan)
            last = plan.n_stages - 1

            def run(s, local, sh, cs, bufs, data, key):
                am = jax.sharding.get_abstract_mesh()

                def laid(x, spec):
                    return jax.lax.with_sharding_constraint(x, NamedSharding(am, spec))

                x0 = pre_g.run([*sh, *cs, *data], key)[0]
                x = laid(jnp.where(s == 0, x0.astype(buf[0]), bufs[0]), x_spec)
                local = [laid(w, P(None, *spec)) if spec else w for w, spec in zip(local, tp_specs)]

                def layer(x, xs):
                    ws, j = xs
                    k = None if key is None else jax.random.fold_in(key, s * per + j)
                    return laid(blk_g.run([*ws, x], k)[0], x_spec), None

                if sp:  # cp's nested region must not sit in a differentiated scan (Note)
                    for j in range(per):
                        x, _ = layer(x, ([w[j] for w in local], j))
                else:
                    x, _ = jax.lax.scan(layer, x, (local, jnp.arange(per)))
                loss = post_g.run([*sh, *cs, x, *data], key)[0]
                loss = jnp.where(s == last, loss.astype(jnp.float32).reshape(()), 0.0)
                return schedules._varying(([x], loss), manual)

            return (jax.checkpoint(run) if plan.remat else run), (buf,)

        plan = schedules.Plan(
            mesh=mesh,
            axis=self.axis,
            n_stages=S,
            n_micro=M,
            stage_fns=(),
            params=(),
            groups=(),
            boundaries=(),
            schedule=self.schedule if train else "forward",
            remat=stages.checkpointed(model),
            batch_axes=batch,
            param_axis=None,
            runner=runner,
            seq_axis=sp,
        )
        self.plan = plan
        return self._finish(plan, named, shared, consts, train, rng)
