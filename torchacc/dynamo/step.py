"""Whole-step compile: forward, backward and optimizer update of a training step as ONE program.

``torchacc.dynamo.compile_step(step_fn)`` returns a callable with ``step_fn``'s signature. Its
first call runs ``step_fn`` eagerly (it creates the optimizer's state); the next call traces the
whole step once with ``make_fx`` under functionalization -- the modules' parameters, buffers and
gradients and the optimizers' state become graph inputs, their in-place updates graph outputs --
and lowers that graph into one jitted JAX program (lower.py). Later calls check the guards below
and launch that program; the new values are written back into the user's tensors, so the model,
the optimizer, ``state_dict()`` and checkpoints see every step.

Note [What a compiled step is keyed on]
Runtime inputs (never recompile): the data of every tensor (batch, parameters, buffers,
gradients, optimizer state including step counters), and each param group's ``lr`` (fed as a
0-d float64 tensor, with the optimizer traced in its ``capturable`` form): LR schedules such as
LambdaLR or CosineAnnealingLR change it every step for free. Guards (a change traces and
compiles once more, counted as ``StepRecompile``; ``TORCHACC_DEBUG=1`` prints which guard
changed): the shapes/dtypes/devices of the tensor arguments and the values of non-tensor
arguments; which parameters have a ``.grad`` when the step starts; every other param-group
hyper-parameter (betas, momentum, weight decay, ...: OneCycleLR's ``cycle_momentum`` recompiles
every step; keep it off); each module's ``training`` flag; the number of param groups; each
GradScaler's settings (Note [GradScaler in a compiled step] in scaler.py). The steady path reads
every parameter's ``.grad`` and every state tensor's ``data_ptr`` once per call, in C-level
``map`` passes (no per-parameter Python): a tensor re-pointed with ``.data =`` runs the step
per tensor instead of through the flat buffers (Note [Flat step buffers]).
Not detected: adding parameters to a module, or replacing a tensor attribute with a new object,
after the step was traced (call ``.reset()`` on the compiled step).

Python inside the step runs once at trace time: ``lr_scheduler.step()`` must be called outside
the compiled function (it is pure Python on the LR; inside, it would be frozen -- a trace that
sees ``lr`` replaced raises); ``.item()``, ``print`` of tensors and data-dependent control flow
are not supported inside (no graph breaks here: use ``torch.compile(backend="torchacc")`` for
such code). Ops without a lowering run eagerly between programs (Note [Fallback policy]).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import time
from collections import defaultdict

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless
from torch.utils import _pytree as pytree

from torchacc import metrics
from torchacc.dynamo import lower, scaler
from torchacc.dynamo.aot import decompositions
from torchacc.dynamo.flat import _FlatRunner
from torchacc.engine import handoff


def compile_step(fn=None, *, models=None, optimizers=None, scalers=None, eager_steps=1):
    """Compile ``fn`` (a training step) into one program; see the module docstring.

    ``models``/``optimizers``/``scalers``: the modules, optimizers and ``GradScaler``s the step
    uses. Default: found among ``fn``'s arguments, closure and the globals it names.
    ``eager_steps``: calls run eagerly before tracing (at least 1 for optimizers that create
    their state lazily)."""
    if fn is None:
        return lambda f: compile_step(
            f, models=models, optimizers=optimizers, scalers=scalers, eager_steps=eager_steps
        )
    return CompiledStep(fn, models, optimizers, scalers, eager_steps)


def _discover(fn, leaves, models, optimizers, scalers):
    found = []
    found.extend(leaves)
    code = getattr(fn, "__code__", None)
    if getattr(fn, "__closure__", None):
        found.extend(c.cell_contents for c in fn.__closure__ if _cell_ok(c))
    found.extend(getattr(fn, "__defaults__", None) or ())  # def step(x, model=model)
    found.extend((getattr(fn, "__kwdefaults__", None) or {}).values())
    if code is not None:
        g = getattr(fn, "__globals__", {})
        found.extend(g[n] for n in code.co_names if n in g)
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        found.append(owner)
    mods = list(models) if models is not None else []
    opts = list(optimizers) if optimizers is not None else []
    if models is None:
        mods = _unique(x for x in found if isinstance(x, torch.nn.Module))
        mods = [m for m in mods if not any(m is not o and _contains(o, m) for o in mods)]
    if optimizers is None:
        opts = _unique(x for x in found if isinstance(x, torch.optim.Optimizer))
    return mods, opts, scaler.find(found if scalers is None else scalers)


def _cell_ok(cell):
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


def _unique(xs):
    out, seen = [], set()
    for x in xs:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _contains(outer, inner):
    return any(m is inner for m in outer.modules())


class _World:
    """The tensors a step reads and writes, numbered once: parameters, buffers, optimizer state."""

    def __init__(self, mods, opts, scalers):
        self.mods, self.opts, self.scalers = mods, opts, scalers
        self.tensors = []
        index = {}

        def number(t):
            i = index.get(id(t))
            if i is None:
                i = index[id(t)] = len(self.tensors)
                self.tensors.append(t)
            return i

        self.mod_names = []
        for m in mods:
            names = {}
            for n, p in m.named_parameters(remove_duplicate=False):
                names[n] = number(p)
            for n, b in m.named_buffers(remove_duplicate=False):
                if b is not None:
                    names[n] = number(b)
            self.mod_names.append(names)
        self.opt_params = []  # per optimizer, per group: tensor indices of its params
        self.opt_state = []  # per optimizer: {param index: {key: ("t", index) | ("v", value)}}
        for o in opts:
            groups = [[number(p) for p in g["params"]] for g in o.param_groups]
            self.opt_params.append(groups)
            state = {}
            for g in o.param_groups:
                for p in g["params"]:
                    entry = {}
                    for k, v in o.state.get(p, {}).items():
                        entry[k] = ("t", number(v)) if isinstance(v, torch.Tensor) else ("v", v)
                    state[index[id(p)]] = entry
            self.opt_state.append(state)
        self.params = _unique(
            [self.tensors[i] for names in self.mod_names for i in names.values()]
            + [self.tensors[i] for gs in self.opt_params for g in gs for i in g]
        )
        self.params = [p for p in self.params if isinstance(p, torch.nn.Parameter)]
        self.param_index = [index[id(p)] for p in self.params]
        self.modules = [sub for m in mods for sub in m.modules()]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.scaler_index = [  # Note [GradScaler in a compiled step]
            tuple(number(t) for t in scaler.state_tensors(s, device)) for s in scalers
        ]

    def guard_key(self, leaves, grads):
        """Note [What a compiled step is keyed on]; ``grads``: the parameters' ``.grad`` now.
        On the steady path (every call): C-level maps, no per-parameter Python."""
        parts = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append((x.shape, x.dtype, x.device, x.requires_grad))
            else:
                parts.append(x if _hashable(x) else ("obj", type(x)))
        hyper = tuple(
            tuple((k, _freeze(v)) for k, v in g.items() if k not in ("params", "lr"))
            for o in self.opts
            for g in o.param_groups
        )
        training = tuple(map(_TRAINING, self.modules))
        has_grad = tuple(map(_NOT_NONE, grads))
        return tuple(parts), has_grad, hyper, training, scaler.guard(self.scalers)

    def lrs(self):
        return [float(g["lr"]) for o in self.opts for g in o.param_groups]


_GRAD = operator.attrgetter("grad")
_TRAINING = operator.attrgetter("training")
_NOT_NONE = functools.partial(operator.is_not, None)


def _hashable(x):
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _freeze(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, float(v) if v.numel() == 1 else id(v))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v if _hashable(v) else id(v)


@contextlib.contextmanager
def _swap_optimizers(world, tensors, lrs):
    """Point every optimizer at the traced tensors (params, state, tensor lr, capturable)."""
    saved = []
    k = 0
    for o, groups, state in zip(world.opts, world.opt_params, world.opt_state):
        saved.append((o, [dict(g) for g in o.param_groups], o.state))
        new_state = defaultdict(dict)
        for g, idx in zip(o.param_groups, groups):
            g["params"] = [tensors[i] for i in idx]
            g["lr"] = lrs[k]
            k += 1
            if "capturable" in g:
                g["capturable"] = True
            for i in idx:
                new_state[tensors[i]] = {
                    key: (tensors[v] if kind == "t" else v) for key, (kind, v) in state[i].items()
                }
        o.state = new_state
    try:
        yield
        current = [g["lr"] for o in world.opts for g in o.param_groups]
        for lr_now, lr_in in zip(current, lrs):
            if lr_now is not lr_in:
                raise RuntimeError(
                    "torchacc.compile_step: the step changed a param group's 'lr' (an LR "
                    "scheduler's .step() inside the compiled function?); call "
                    "scheduler.step() outside the compiled step"
                )
    finally:
        for o, groups, st in saved:
            for g, old in zip(o.param_groups, groups):
                g.clear()
                g.update(old)
            o.state = st


class CompiledStep:
    """The callable ``compile_step`` returns."""

    def __init__(self, fn, models, optimizers, scalers, eager_steps):
        self.fn = fn
        self._models, self._optimizers, self._scalers = models, optimizers, scalers
        self._eager_left = eager_steps
        self.reset()

    def reset(self):
        """Forget traced programs and the discovered modules/optimizers (retrace next call)."""
        self._world = None
        self._programs = {}
        self._last_key = None
        self._specs = {}  # number of positional tensor arguments -> their pytree spec

    def __call__(self, *args, **kwargs):
        if self._eager_left > 0:
            self._eager_left -= 1
            return self.fn(*args, **kwargs)
        if not kwargs and all([isinstance(a, torch.Tensor) for a in args]):  # without pytree
            leaves, spec = list(args), self._specs.get(len(args))
            if spec is None:
                spec = self._specs[len(args)] = pytree.tree_flatten((args, kwargs))[1]
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
        if self._world is None:
            found = _discover(self.fn, leaves, self._models, self._optimizers, self._scalers)
            _state_onto_device(found[1])
            self._world = _World(*found)
        world = self._world
        grads = list(map(_GRAD, world.params))
        key = (world.guard_key(leaves, grads), spec)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._new_program(key, leaves, spec)
        metrics.counter_inc("StepExecute")
        return prog.run(world, leaves, grads)

    def _new_program(self, key, leaves, spec):
        if self._programs:
            metrics.counter_inc("StepRecompile")
            if lower.debug_enabled():
                print(
                    f"torchacc.compile_step: retracing: {_diff(key, self._last_key)}",
                    file=sys.stderr,
                )
        start = time.perf_counter()
        prog = _StepProgram(self.fn, self._world, leaves, spec)
        metrics.record_time("StepTraceTime", time.perf_counter() - start)
        metrics.counter_inc("StepTrace")
        self._programs[key] = prog
        self._last_key = key
        return prog


def _diff(key, old):
    if old is None:
        return "first trace"
    (a_args, a_grads, a_hyper, a_train, a_scal), a_spec = key
    (b_args, b_grads, b_hyper, b_train, b_scal), b_spec = old
    if a_spec != b_spec:
        return "the step's arguments have a different structure"
    for i, (x, y) in enumerate(zip(a_args, b_args)):
        if x != y:
            return f"argument leaf {i} is {x}, was {y}"
    if a_grads != b_grads:
        return "a different set of parameters has .grad at the start of the step"
    if a_hyper != b_hyper:
        return f"an optimizer hyper-parameter changed: {a_hyper} vs {b_hyper}"
    if a_train != b_train:
        return "a module's training flag changed"
    if a_scal != b_scal:
        return f"a GradScaler setting changed: {a_scal} vs {b_scal}"
    return "unknown"


class _StepProgram:
    """One traced step: its lowered graph and how its inputs/outputs map onto the user's tensors."""

    def __init__(self, fn, world, leaves, spec):
        self.spec = spec
        self.arg_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.grad_in = [k for k, p in enumerate(world.params) if p.grad is not None]
        n_state = len(world.tensors)
        n_grad = len(self.grad_in)
        n_args = len(self.arg_pos)
        n_lr = len(world.lrs())
        self.out_info = None

        def step(*flat):
            tensors = list(flat[:n_state])
            grads = flat[n_state : n_state + n_grad]
            batch = flat[n_state + n_grad : n_state + n_grad + n_args]
            lrs = list(flat[n_state + n_grad + n_args :])
            for k, g in zip(self.grad_in, grads):
                tensors[world.param_index[k]].grad = g
            new_leaves = list(leaves)
            for i, t in zip(self.arg_pos, batch):
                new_leaves[i] = t
            args, kwargs = pytree.tree_unflatten(new_leaves, spec)
            with contextlib.ExitStack() as stack:
                for m, names in zip(world.mods, world.mod_names):
                    stack.enter_context(
                        stateless._reparametrize_module(
                            m, {n: tensors[i] for n, i in names.items()}, tie_weights=True
                        )
                    )
                stack.enter_context(_swap_optimizers(world, tensors, lrs))
                stack.enter_context(scaler.swapped(world.scalers, tensors, world.scaler_index))
                out = self.fn(*args, **kwargs)
            out_leaves, out_spec = pytree.tree_flatten(out)
            grads_out = [tensors[i].grad for i in world.param_index]
            self.out_info = (
                out_spec,
                [isinstance(x, torch.Tensor) for x in out_leaves],
                [g is not None for g in grads_out],
            )
            return [x for x in out_leaves if isinstance(x, torch.Tensor)] + [
                g for g in grads_out if g is not None
            ], [x for x in out_leaves if not isinstance(x, torch.Tensor)]

        self.fn = fn
        example = (
            [_example(t, isinstance(t, torch.nn.Parameter)) for t in world.tensors]
            + [world.params[k].grad.detach() for k in self.grad_in]
            + [leaves[i].detach() for i in self.arg_pos]
            + [torch.tensor(lr, dtype=torch.float64) for lr in world.lrs()]
        )
        consts = []

        def traced(*flat):
            tensors, others = step(*flat)
            consts[:] = others
            return tensors

        # Two traces: the step as ATen ops (autograd's backward included; functorch's
        # functionalize forbids .backward()), then that graph functionalized.
        with torch.compiler._compile_session_context():
            raw = make_fx(traced, tracing_mode="fake", decomposition_table=_decompositions())(
                *example
            )
            plain = [e.detach() for e in example]
            gm = make_fx(
                torch.func.functionalize(raw, remove="mutations_and_views"),
                tracing_mode="fake",
                decomposition_table=_decompositions(),
            )(*plain)
        self.consts = consts
        self.n_inputs = n_state + n_grad + n_args + n_lr
        _strip_profiler(gm)
        self.mutated = _move_input_mutations_to_outputs(gm)  # [(placeholder index, output pos)]
        first_lr = n_state + n_grad + n_args
        if any(i >= first_lr for i, _ in self.mutated):
            raise RuntimeError(
                "torchacc.compile_step: the step changed a param group's 'lr' (an LR "
                "scheduler's .step() inside the compiled function?); call scheduler.step() "
                "outside the compiled step"
            )
        self.arg_mutations = [
            (i - n_state - n_grad, pos) for i, pos in self.mutated if n_state + n_grad <= i
        ]
        self.lowered = lower.Lowered(gm, name="step")
        out_spec, is_tensor, has_grad = self.out_info
        self.n_user = sum(is_tensor)
        self.single_output = out_spec.is_leaf() and is_tensor == [True]
        self.grad_out = [k for k, h in enumerate(has_grad) if h]
        # SPMD: state keeps its sharding, a gradient takes its parameter's (Note [Device
        # tensors in a trace-once program] in torchacc/engine/handoff.py)
        self.lowered.keep_shardings(
            [(pos, i) for i, pos in self.mutated]
            + [(self.n_user + j, world.param_index[k]) for j, k in enumerate(self.grad_out)]
        )
        self.flat = _FlatRunner.build(self, world, n_state, n_grad, n_args)

    def run(self, world, leaves, grads):
        if self.flat is not None and self.flat.valid(world):
            outs = self.flat.run(world, leaves, grads)
        else:
            outs = self._run_per_tensor(world, leaves)
        out_spec, is_tensor, _ = self.out_info
        if self.single_output:
            return outs[0]
        user, others = iter(outs), iter(self.consts)
        leaves_out = [next(user) if t else next(others) for t in is_tensor]
        return pytree.tree_unflatten(leaves_out, out_spec)

    def _run_per_tensor(self, world, leaves):
        inputs = list(world.tensors)
        params = world.params
        inputs.extend(params[k].grad for k in self.grad_in)
        inputs.extend(leaves[i] for i in self.arg_pos)
        inputs.extend(world.lrs())
        outs = self.lowered(inputs)
        n_user = self.n_user
        for j, k in enumerate(self.grad_out):
            params[k].grad = outs[n_user + j]
        has = set(self.grad_out)
        for k in range(len(params)):
            if k not in has and params[k].grad is not None:
                params[k].grad = None
        tensors = world.tensors
        write = _rebind if self.lowered.on_device else _copy
        with torch.no_grad():
            for i, pos in self.mutated:
                if i < len(tensors):
                    write(tensors[i], outs[pos])
            for j, pos in self.arg_mutations:  # the step wrote into one of its arguments
                write(leaves[self.arg_pos[j]], outs[pos])
        return outs[:n_user]


def _state_onto_device(opts):
    """Optimizer state kept on the CPU (AdamW's ``step`` counters) of parameters on the torchacc
    device moves there: the traced step updates it on the device (``capturable``), and writing
    a result back into a CPU tensor would read it back every step."""
    for o in opts:
        for p, entry in o.state.items():
            if not handoff.is_device_tensor(p):
                continue
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    entry[k] = v.to(p.device)


def _copy(t, new):
    t.copy_(new)


def _rebind(t, new):
    """A torchacc-device tensor takes the program's result as its data (no recorded copy)."""
    handoff.rebind(t, handoff.array_of(new))


@functools.lru_cache(maxsize=None)
def _decompositions():
    return {**decompositions(), **scaler.decompositions()}


def _example(t, requires_grad):
    e = t.detach()
    if requires_grad:
        e = e.requires_grad_(True)
    return e


def _strip_profiler(gm):
    """Drop torch.optim's record_function markers (profiler ops with no effect on values)."""
    nodes = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "profiler"
    ]
    for n in reversed(nodes):
        for u in list(n.users):
            if u not in nodes:
                return  # a value depends on a marker: keep them all
        gm.graph.erase_node(n)


def _move_input_mutations_to_outputs(gm):
    """Replace the trailing ``copy_(input, value)`` nodes functionalization emits for mutated
    inputs by extra graph outputs; returns [(input index, output position)]."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(placeholders)}
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    mutated = []
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten.copy_.default
            and node.args[0] in pos
            and not node.users
        ):
            mutated.append((pos[node.args[0]], len(outs)))
            outs.append(node.args[1])
            graph.erase_node(node)
    out_node.args = (outs,)
    graph.lint()
    gm.recompile()
    return mutated
