"""``PipelineModule``: a torch model cut into stages that live on the ``pp`` axis of the one mesh
(Note [Pipeline stages on the pp axis] in torchacc/pipeline/__init__.py). It owns the packed
parameters (one ``[stages, width]`` row per stage and dtype, split over ``pp``), the shared
parameters and the buffers; ``forward_backward`` records one node running the whole pipelined
step (schedules.py) and accumulates the gradients into ``.grad``, as ``loss.backward()`` would.
"""

from __future__ import annotations

import inspect
import math

import jax
import torch

from torchacc.lazy import region as traced_regions
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lowering import region as ops
from torchacc.lowering.dtypes import jdtype
from torchacc.pipeline import schedules, stages
from torchacc.sharding import api

SCHEDULE_NAMES = {
    "1f1b": "1f1b",
    "pipedreamflush": "1f1b",  # TorchAcc's name (schedule.Algo.PipeDreamFlush)
    "gpipe": "gpipe",
}


def schedule_name(schedule):
    """``schedule`` (``"1F1B"``, ``"PipeDreamFlush"``, ``"GPipe"``, any case, or an enum with
    such a name) as ``"1f1b"`` / ``"gpipe"``; ``ValueError`` otherwise."""
    key = getattr(schedule, "name", schedule)
    name = SCHEDULE_NAMES.get(str(key).lower()) if key is not None else None
    if name is None:
        raise ValueError(
            f"pipeline parallel: schedule must be one of '1F1B' (TorchAcc's PipeDreamFlush) or "
            f"'GPipe', got {schedule!r}"
        )
    return name


class _Shape:
    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


class PipelineModule(torch.nn.Module):
    """``model`` cut before each split point into ``pp`` stages on the ``pp`` mesh axis.

    ``forward_backward(*inputs, output_fn=..., **kwargs)`` runs forward and backward over
    ``num_micro_batches`` micro-batches (GPipe or 1F1B) as one compiled step, accumulates the
    parameters' gradients and returns the loss (the mean of the micro-batches' losses).
    ``forward(...)`` is the same without gradients. ``parameters()`` are the packed rows, the
    shared parameters (read by several stages, e.g. tied embeddings: replicated over pp) and
    nothing else; ``unpacked()`` gives them (or their gradients) by the model's own names."""

    def __init__(
        self,
        model,
        size,
        split_points,
        num_micro_batches=1,
        schedule="1f1b",
        mesh=None,
        axis="pp",
        fsdp=1,
        topology=("dp", "fsdp", "pp"),
        dp=None,
        autocast=None,
    ):
        torch.nn.Module.__init__(self)
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int):
            raise ValueError(
                f"pipeline parallel: num_micro_batches must be an int, got {num_micro_batches!r}"
            )
        if num_micro_batches < 1:
            raise ValueError(f"pipeline parallel: num_micro_batches={num_micro_batches} < 1")
        sched = schedule_name(schedule)
        names = stages.resolve_split_points(model, split_points, size)
        self.num_stages = size
        split = self._cut(model, names)  # ValueError before anything changes
        object.__setattr__(self, "_underlay", model)
        self._split, self.num_micro_batches = split, num_micro_batches
        self.schedule, self.split_points, self.axis = sched, names, axis
        self._mesh, self._fsdp, self._topology, self._dp = mesh, fsdp, tuple(topology), dp
        if mesh is not None:
            self._fsdp = int(dict(mesh.shape).get("fsdp", 1))
        self._signature = inspect.signature(model.forward)
        self._autocast_default = autocast  # Config.compute.bf16/fp16 through accelerate
        self._pack(model)
        self._steps: dict = {}
        self._placed = False

    def _cut(self, model, names):
        """The model cut into stages (stages.Stages; uniform.Chain overrides)."""
        return stages.Stages(model, names)

    # -----------------------------------------------------------------------------------------
    # parameters

    def _pack(self, model):
        split, S = self._split, self.num_stages
        aliases: dict = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        for name, b in model.named_buffers(remove_duplicate=False):
            aliases.setdefault(id(b), []).append(name)
        self._aliases = aliases
        owned = [[] for _ in range(S)]  # per stage: (name, param)
        shared = []
        for name, p in model.named_parameters():
            users = split.uses.get(id(p), {0})
            if len(users) == 1:
                owned[next(iter(users))].append((name, p))
            else:
                shared.append((name, p))
        groups: dict = {}  # (dtype, requires_grad) -> group index
        layout = [[] for _ in range(S)]  # per stage: (name, group, offset, shape)
        fill: dict = {}
        for k in range(S):
            for name, p in owned[k]:
                g = groups.setdefault((p.dtype, p.requires_grad), len(groups))
                o = fill.get((k, g), 0)
                layout[k].append((name, g, o, tuple(p.shape)))
                fill[k, g] = o + p.numel()
        pad = max(1, self._fsdp)
        widths = []
        for _, g in sorted(groups.items(), key=lambda kv: kv[1]):
            w = max([fill.get((k, g), 0) for k in range(S)] + [1])
            widths.append(-(-w // pad) * pad)
        self._groups = [
            (dtype, rg, widths[g])
            for (dtype, rg), g in sorted(groups.items(), key=lambda kv: kv[1])
        ]
        self._layout = layout
        by_name = dict(model.named_parameters())
        with torch.no_grad():
            for g, (dtype, rg, w) in enumerate(self._groups):
                rows = torch.zeros(S, w, dtype=dtype)
                for k in range(S):
                    for name, gg, o, shape in layout[k]:
                        if gg == g:
                            rows[k, o : o + math.prod(shape)] = by_name[name].detach().reshape(-1)
                self.register_parameter(f"packed_{g}", torch.nn.Parameter(rows, rg))
            self._shared_names = [n for n, _ in shared]
            for i, (_, p) in enumerate(shared):
                self.register_parameter(
                    f"shared_{i}", torch.nn.Parameter(p.detach().clone(), p.requires_grad)
                )
            self._buffer_names = [n for n, _ in model.named_buffers()]
            for i, (_, b) in enumerate(model.named_buffers()):
                self.register_buffer(f"const_{i}", b.detach().clone())
        self._param_ids = {n: id(p) for n, p in model.named_parameters()}
        self._buffer_ids = {n: id(b) for n, b in model.named_buffers()}

    def _packed(self):
        return [getattr(self, f"packed_{g}") for g in range(len(self._groups))]

    def _shared(self):
        return [getattr(self, f"shared_{i}") for i in range(len(self._shared_names))]

    def _consts(self):
        return [getattr(self, f"const_{i}") for i in range(len(self._buffer_names))]

    def unpacked(self, grads=False):
        """The model's parameters (or, with ``grads``, their gradients: None where there is
        none yet) by the model's own names, as slices of the packed rows."""
        out = {}
        for g, packed in enumerate(self._packed()):
            src = packed.grad if grads else packed
            for k in range(self.num_stages):
                for name, gg, o, shape in self._layout[k]:
                    if gg == g:
                        out[name] = (
                            None if src is None else src[k, o : o + math.prod(shape)].view(shape)
                        )
        for name, p in zip(self._shared_names, self._shared()):
            out[name] = p.grad if grads else p
        return out

    # -----------------------------------------------------------------------------------------
    # placement on the mesh

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == DEVICE_TYPE:
            api.use_spmd()  # before anything is uploaded (a multi-process job joins JAX so)
        out = super().to(*args, **kwargs)
        if device is not None and device.type == DEVICE_TYPE:
            self._place()
        return out

    def mesh(self):
        """The mesh the stages live on (built from the sizes on first use)."""
        if self._mesh is None:
            api.use_spmd()
            n = api.device_count()
            S, f = self.num_stages, max(1, self._fsdp)
            if n % (S * f):
                raise ValueError(
                    f"pipeline parallel: pp.size={S} x fsdp.size={f} does not divide the job's "
                    f"{n} devices"
                )
            dp = self._dp or n // (S * f)
            if dp * S * f != n:
                raise ValueError(
                    f"pipeline parallel: dp={dp} x fsdp={f} x pp={S} != the job's {n} devices"
                )
            size = {"dp": dp, "fsdp": f, self.axis: S}
            order = [a if a != "pp" else self.axis for a in self._topology]
            names = [a for a in order if a in size] + [a for a in size if a not in order]
            self._mesh = api.jax_mesh(range(n), [size[a] for a in names], names)
        return self._mesh

    def _axes(self):
        mesh = self.mesh()
        shape = dict(mesh.shape)
        batch = tuple(a for a in mesh.axis_names if a in ("dp", "fsdp") and shape[a] > 1)
        param = "fsdp" if shape.get("fsdp", 1) > 1 else None
        return batch, param

    def _place(self):
        mesh = self.mesh()
        api.adopt_mesh(mesh)
        _, param = self._axes()
        for p in self._packed():
            api.mark(p, api.named_sharding(mesh, (self.axis, param), tuple(p.shape), "pipeline"))
        for t in [*self._shared(), *self._consts()]:
            api.mark(t, api.named_sharding(mesh, (None,) * t.dim(), tuple(t.shape), "pipeline"))
        self._placed = True

    # -----------------------------------------------------------------------------------------
    # the step

    def _underlay_model(self):
        return self._underlay

    def _bind(self, args, kwargs, output_fn):
        """(forward inputs by name, output_fn's keyword arguments) from the call."""
        bound = dict(kwargs)
        params = list(self._signature.parameters.values())
        if len(args) > len(params):
            raise ValueError(
                f"pipeline parallel: {len(args)} positional inputs for a forward of "
                f"{len(params)} parameters"
            )
        for p, a in zip(params, args):
            if p.name in bound:
                raise ValueError(f"pipeline parallel: input {p.name!r} given twice")
            bound[p.name] = a
        forward_names = {ph.target for ph in self._split.inputs}
        inputs = {k: v for k, v in bound.items() if k in forward_names}
        out_kwargs = {}
        if output_fn is not None:
            for p in list(inspect.signature(output_fn).parameters.values())[1:]:
                if p.name in bound:
                    out_kwargs[p.name] = bound[p.name]
                elif p.default is inspect.Parameter.empty:
                    raise ValueError(
                        f"pipeline parallel: output_fn's argument {p.name!r} is not among the "
                        f"inputs given to forward_backward ({sorted(bound)})"
                    )
        return inputs, out_kwargs

    def _check_batch(self, data):
        M = self.num_micro_batches
        batch, _ = self._axes()
        shape = dict(self.mesh().shape)
        nb = math.prod(shape[a] for a in batch)
        sizes = {n: tuple(t.shape) for n, t in data if isinstance(t, torch.Tensor)}
        for n, s in sizes.items():
            if not s:
                raise ValueError(
                    f"pipeline parallel: input {n!r} is a 0-d tensor; every tensor input is "
                    "split into micro-batches along dim 0"
                )
            if s[0] % M:
                raise ValueError(
                    f"pipeline parallel: num_micro_batches={M} does not divide the batch size "
                    f"{s[0]} of input {n!r} (shape {s})"
                )
            if s[0] % (M * nb):
                raise ValueError(
                    f"pipeline parallel: the batch size {s[0]} of input {n!r} is not divisible "
                    f"by num_micro_batches={M} x {nb} data-parallel devices ({batch})"
                )
        if len({s[0] for s in sizes.values()}) > 1:
            raise ValueError(f"pipeline parallel: the inputs' batch sizes differ: {sizes}")
        return nb

    def forward_backward(self, *args, output_fn=None, **kwargs):
        """Forward and backward of every micro-batch through the stages (the schedule of
        ``pp.schedule``), as ``loss = output_fn(model(*args, **kwargs), **its kwargs);
        loss.backward()`` per micro-batch would, the loss averaged over them: gradients
        accumulate into ``.grad``; returns the mean loss."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "forward_backward() needs gradients enabled; use forward() under no_grad"
            )
        return self._run(args, kwargs, output_fn, train=True)

    def forward(self, *args, output_fn=None, **kwargs):
        """The mean loss over the micro-batches, without gradients (GPipe forward ticks)."""
        return self._run(args, kwargs, output_fn, train=False)

    def _run(self, args, kwargs, output_fn, train):
        inputs, out_kwargs = self._bind(args, kwargs, output_fn)
        named = [*inputs.items(), *out_kwargs.items()]
        nb = self._check_batch(named)
        if not self._placed:
            from torchacc.lazy.device import device

            self.to(device())
        dev = self._packed()[0].device
        named = [
            (n, v.to(dev) if isinstance(v, torch.Tensor) and v.device != dev else v)
            for n, v in named
        ]
        tensors = [v for _, v in named if isinstance(v, torch.Tensor)]
        autocast = _autocast_dtype() or self._autocast_default
        key = (
            tuple(
                (n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, repr(v))
                for n, v in named
            ),
            tuple(inputs),
            getattr(output_fn, "__code__", output_fn),
            autocast,
            train,
            stages.checkpointed(self._underlay),
        )
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._build(
                named, len(inputs), nb, output_fn, autocast, train
            )
        call, rng = step
        params = [*self._packed(), *self._shared(), *self._consts()]
        op = ops.call_jax_rng if rng else ops.call_jax
        with torch.no_grad():  # the gradients are the node's own results
            outs = op([*params, *tensors], call.key)
        if not train:
            return outs[0]
        for p, g in zip([*self._packed(), *self._shared()], outs[1:]):
            if not p.requires_grad:
                continue
            p.grad = g if p.grad is None else p.grad + g
        return outs[0]

    def _build(self, named, n_inputs, nb, output_fn, autocast, train):
        split, S, M = self._split, self.num_stages, self.num_micro_batches
        model = self._underlay
        model.train(train)
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
        fns, bnd_meta, bnd_in = [], [], ([], [])  # (stand-ins/consts per boundary value)
        rng = False
        for k in range(S):
            own = [(name, shape, self._dtype_of(g)) for name, g, _, shape in self._layout[k]]
            n_own, n_sh, n_c = len(own), len(shared), len(consts)
            prev_nodes = split.boundaries[k - 1] if k else []
            prev_vals = bnd_in  # (tensor stand-ins, per node: ("t", i) or ("c", value))

            def fn(
                *flat,
                k=k,
                own=own,
                prev_nodes=prev_nodes,
                prev_vals=prev_vals,
                n_own=n_own,
                n_sh=n_sh,
                n_c=n_c,
            ):
                i = 0
                mapping = {}
                for (name, _, _), t in zip(own, flat[i : i + n_own]):
                    for a in self._aliases[self._param_ids[name]]:
                        mapping[a] = t
                i += n_own
                for (name, _), t in zip(shared, flat[i : i + n_sh]):
                    for a in self._aliases[self._param_ids[name]]:
                        mapping[a] = t
                i += n_sh
                for (name, _), t in zip(consts, flat[i : i + n_c]):
                    for a in self._aliases[self._buffer_ids[name]]:
                        mapping[a] = t
                i += n_c
                n_b = len(prev_vals[0])
                bts = list(flat[i : i + n_b])
                i += n_b
                values = {}
                for node, (kind, v) in zip(prev_nodes, prev_vals[1]):
                    values[node] = bts[v] if kind == "t" else v
                data = dict(statics)
                data.update(zip(tensor_names, flat[i:]))
                ins = {n: v for n, v in data.items() if n in input_names}
                outk = {n: v for n, v in data.items() if n not in input_names}
                with stages.reparametrized(model, mapping), _autocast(autocast):
                    res = split.run(k, values, ins, output_fn, outk)
                return res if k < S - 1 else (res,)

            standins = [
                *[_Shape(shape, dt) for _, shape, dt in own],
                *[_Shape(t.shape, t.dtype) for _, t in shared],
                *[_Shape(t.shape, t.dtype) for _, t in consts],
                *prev_vals[0],
                *data_standins,
            ]
            with torch.set_grad_enabled(False):
                traced = traced_regions.trace(fn, standins, f"pipeline stage {k}")
            if traced.closures:
                raise ValueError(
                    f"pipeline parallel: stage {k} reads {len(traced.closures)} torchacc "
                    "tensor(s) that are neither parameters nor buffers of the model (shapes "
                    f"{[tuple(t.shape) for t in traced.closures]}); make them buffers"
                )
            graph = ops.GRAPHS[traced.key]
            rng = rng or graph.rng
            if k < S - 1:
                metas, per_node, ti = [], [], 0
                for j, leaf in enumerate(traced.out_consts):
                    if j in traced.out_pos:
                        shape, dtype = graph.out_meta[traced.out_pos.index(j)]
                        metas.append(_Shape(shape, dtype))
                        per_node.append(("t", ti))
                        ti += 1
                    else:
                        per_node.append(("c", leaf))
                bnd_in = (metas, per_node)
                bnd_meta.append(tuple((m.shape, jdtype(m.dtype)) for m in metas))
            else:
                if len(graph.out_meta) != 1 or graph.out_meta[0][0] != ():
                    raise ValueError(
                        "pipeline parallel: the loss (output_fn's result, or the model's) must "
                        f"be one 0-d tensor, got {[m[0] for m in graph.out_meta]}"
                    )
            fns.append(_jax_stage(graph))
        mesh = self.mesh()
        batch, param = self._axes()
        plan = schedules.Plan(
            mesh=mesh,
            axis=self.axis,
            n_stages=S,
            n_micro=M,
            stage_fns=tuple(fns),
            params=tuple(
                tuple((g, o, shape) for _, g, o, shape in self._layout[k]) for k in range(S)
            ),
            groups=tuple((jdtype(d), w) for d, _, w in self._groups),
            boundaries=tuple(bnd_meta),
            schedule=self.schedule if train else "forward",
            remat=stages.checkpointed(model),
            batch_axes=batch,
            param_axis=param,
        )
        self.plan = plan
        return self._finish(plan, named, shared, consts, train, rng)

    def _finish(self, plan, named, shared, consts, train, rng):
        """The recorded call running ``plan``'s step on the packed parameters, the shared ones,
        the buffers and the batch."""
        step = schedules.make_step(plan)
        n_p, n_s, n_c = len(self._packed()), len(shared), len(consts)
        laid = self._grad_shardings()

        def run(*arrays, rng=None):
            packed = list(arrays[:n_p])
            sh = list(arrays[n_p : n_p + n_s])
            cs = list(arrays[n_p + n_s : n_p + n_s + n_c])
            data = list(arrays[n_p + n_s + n_c :])
            if not train:
                return (step(packed, sh, cs, data, rng),)
            loss, gp, gs = step(packed, sh, cs, data, rng)
            if laid is not None:  # the shared parameters' gradients in their own layout
                gs = [jax.lax.with_sharding_constraint(g, s) for g, s in zip(gs, laid)]
            return (loss, *gp, *gs)

        run.__name__ = f"pipeline_{self.schedule if train else 'forward'}"
        params = [*self._packed(), *self._shared(), *self._consts()]
        tensors = [*params, *[v for _, v in named if isinstance(v, torch.Tensor)]]
        specs = [jax.ShapeDtypeStruct(tuple(t.shape), jdtype(t.dtype)) for t in tensors]
        _, treedef = jax.tree_util.tree_flatten((tuple(specs), {}))
        out_meta = [((), torch.float32)]
        if train:
            out_meta += [(tuple(p.shape), p.dtype) for p in [*self._packed(), *self._shared()]]
        _, out_tree = jax.tree_util.tree_flatten(tuple(range(len(out_meta))))
        precision = jax.config.jax_default_matmul_precision
        call = ops.JaxCall(run, treedef, range(len(specs)), {}, precision, out_meta, out_tree)
        return call, rng

    def _grad_shardings(self):
        """Shardings of the shared parameters' gradients (None: as the step gives them)."""
        return None

    def _dtype_of(self, g):
        return self._groups[g][0]

    def param_bytes_per_stage(self):
        """Bytes of the packed parameters one device holds (one row of every group, split
        over fsdp)."""
        f = max(1, self._fsdp)
        return sum(w * d.itemsize for d, _, w in self._groups) // f


def _jax_stage(graph):
    def stage(params, shared, consts, bnd_in, data, key):
        return graph.run([*params, *shared, *consts, *bnd_in, *data], key)

    return stage


def _autocast_dtype():
    """The autocast dtype active around the call (the torchacc device's, else CUDA's: TorchAcc's
    scripts write ``torch.cuda.amp.autocast``), or None."""
    for dev in (DEVICE_TYPE, "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                return torch.get_autocast_dtype(dev)
        except RuntimeError:
            continue
    return None


def _autocast(dtype):
    import contextlib

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(DEVICE_TYPE, dtype=dtype)
