"""Splitting a torch model into pipeline stages: the split points checked and resolved, the
forward traced once with ``torch.fx`` (the split-point modules kept whole), its nodes cut into
stages *before* each split point, and what each stage hands the next (Note [Pipeline stages on
the pp axis] in torchacc/pipeline/__init__.py). Each stage is then a torch function of its
parameters, the shared parameters and buffers, the boundary values it receives and the
micro-batch's inputs, which torchacc/pipeline/module.py traces into a JAX function.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.nn.utils.stateless import _reparametrize_module


def resolve_split_points(model, split_points, size):
    """The split points as module names, in the model's module order; ``ValueError`` naming the
    sizes or the name when they do not make ``size`` stages. Changes nothing."""
    points = list(split_points or [])
    if size != len(points) + 1:
        raise ValueError(
            f"pipeline parallel: pp.size={size} needs len(split_points) + 1 == pp.size, got "
            f"{len(points)} split points ({len(points) + 1} stages): {_names(points)}"
        )
    by_module = {id(m): n for n, m in model.named_modules() if n}
    names = []
    for p in points:
        if isinstance(p, torch.nn.Module):
            if id(p) not in by_module:
                raise ValueError(
                    f"pipeline parallel: split point {type(p).__name__} is no submodule of "
                    f"the {type(model).__name__} model ({size} stages, {len(points)} split "
                    "points)"
                )
            names.append(by_module[id(p)])
        elif isinstance(p, str):
            try:
                m = model.get_submodule(p)
            except AttributeError:
                m = None
            if m is None or m is model:
                known = [n for n, _ in model.named_modules() if n]
                raise ValueError(
                    f"pipeline parallel: split point {p!r} names no module of the "
                    f"{type(model).__name__} model ({size} stages, {len(points)} split "
                    f"points; its modules: {known[:20]}{' ...' if len(known) > 20 else ''})"
                )
            names.append(p)
        else:
            raise ValueError(
                f"pipeline parallel: a split point is a module name or a module, got {p!r}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"pipeline parallel: split points repeat a module: {names}")
    return names


def _names(points):
    return [p if isinstance(p, str) else type(p).__name__ for p in points]


class _Tracer(torch.fx.Tracer):
    """FX's tracer keeping the split-point modules whole (one ``call_module`` node each)."""

    def __init__(self, keep):
        super().__init__()
        self.keep = set(keep)

    def is_leaf_module(self, m, qualname):
        return qualname in self.keep or super().is_leaf_module(m, qualname)


def _checkpointed(m):
    """``apply_gc`` replaced this module's forward (Config.memory.gc / gradient_checkpoint)."""
    f = m.__dict__.get("forward")
    return f is not None and "_checkpointed_forward" in getattr(f, "__qualname__", "")


class Stages:
    """``model``'s forward cut before each of ``names``.

    ``stage_nodes[k]``: the graph's nodes run by stage k, in order; ``boundaries[k]``: the nodes
    computed by stages <= k and read by a later stage (what stage k hands stage k + 1);
    ``inputs``: the forward's placeholders; parameters and buffers are read by every stage that
    needs them (``uses``), never handed on."""

    def __init__(self, model, names):
        self.model, self.names = model, list(names)
        try:
            graph = _Tracer(names).trace(model)
        except Exception as e:  # noqa: BLE001 -- FX's own errors, named
            raise ValueError(
                f"pipeline parallel: torch.fx cannot trace {type(model).__name__}.forward to "
                f"split it into stages: {type(e).__name__}: {e}"
            ) from e
        self.graph = graph
        self.inputs = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        n_stages = len(names) + 1
        stage_of, k = {}, 0
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if node.op == "call_module" and k < len(names) and node.target == names[k]:
                k += 1
            stage_of[node] = k
        if k < len(names):
            raise ValueError(
                f"pipeline parallel: split point {names[k]!r} is never called by "
                f"{type(model).__name__}.forward before {names[k - 1] if k else 'the start'!r} "
                f"(split points in call order: {names}; {n_stages} stages)"
            )
        self.stage_of = stage_of
        self.stage_nodes = [
            [n for n in graph.nodes if stage_of.get(n) == s] for s in range(n_stages)
        ]
        last = n_stages - 1
        users_stage = {}
        for node in graph.nodes:
            reader = last if node.op == "output" else stage_of.get(node)
            if reader is None:
                continue
            for u in node.all_input_nodes:
                users_stage[u] = max(users_stage.get(u, -1), reader)
        self.boundaries = [
            [n for n in graph.nodes if n in stage_of and stage_of[n] <= s < users_stage.get(n, -1)]
            for s in range(n_stages - 1)
        ]
        # which stages read each parameter / buffer (by tensor identity)
        uses: dict = {}
        for node in graph.nodes:
            s = last if node.op == "output" else stage_of.get(node)
            tensors = []
            if node.op == "call_module":
                m = model.get_submodule(node.target)
                tensors = [*m.parameters(), *m.buffers()]
            for u in node.all_input_nodes:
                if u.op == "get_attr":
                    tensors.append(_attr(model, u.target))
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    uses.setdefault(id(t), set()).add(s)
        self.uses = uses

    def run(self, k, values, inputs, output_fn=None, out_kwargs=None, bypass_gc=True):
        """Stage ``k`` on torch values: ``values`` (boundary node -> value, stage k - 1's
        boundary), ``inputs`` (placeholder name -> value). Returns the boundary values it hands
        on (a list, in ``boundaries[k]``'s order), or for the last stage the loss
        ``output_fn(output, **out_kwargs)`` (the output itself when there is no output_fn)."""
        model = self.model
        env = dict(values)
        for ph in self.inputs:
            if ph.target in inputs:
                env[ph] = inputs[ph.target]
            elif ph.args:
                env[ph] = ph.args[0]
            else:
                env[ph] = None

        def load(n):
            if n.op == "get_attr":
                return _attr(model, n.target)
            return env[n]

        for node in self.stage_nodes[k]:
            args = map_arg(node.args, load)
            kwargs = map_arg(node.kwargs, load)
            if node.op == "call_function":
                env[node] = node.target(*args, **kwargs)
            elif node.op == "call_method":
                self_obj, *rest = args
                env[node] = getattr(self_obj, node.target)(*rest, **kwargs)
            elif node.op == "call_module":
                m = model.get_submodule(node.target)
                if bypass_gc and _checkpointed(m):  # the stage is recomputed whole instead
                    env[node] = type(m).forward(m, *args, **kwargs)
                else:
                    env[node] = m(*args, **kwargs)
            else:
                raise ValueError(f"pipeline parallel: unexpected FX node {node.op} {node}")
        if k < len(self.boundaries):
            return [env[n] for n in self.boundaries[k]]
        out = map_arg(self.output.args[0], load)
        if output_fn is not None:
            return output_fn(out, **(out_kwargs or {}))
        return _loss_of(out)


def _loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "pipeline parallel: the model returned no loss; pass output_fn=... to "
            f"forward_backward (it got {type(out).__name__})"
        )
    return loss


def _attr(model, target):
    obj = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def reparametrized(model, mapping):
    """``model`` reading ``mapping``'s tensors (name -> tensor, every alias of a tied
    parameter named) in place of its own, for the duration of a ``with``."""
    return _reparametrize_module(model, mapping)


def checkpointed(model):
    """Whether any submodule of ``model`` is gradient-checkpointed (``apply_gc``)."""
    return any(_checkpointed(m) for m in model.modules())
