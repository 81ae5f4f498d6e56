"""AUTO_PARALLEL: a small strategy search over a model's Linear and Embedding layers, and the
strategy table that says what it chose and why.

Note [The auto-parallel search]
The JAX this project uses (0.10) has no entry point to XLA's auto-sharding pass
(``jax.sharding.AUTO`` of older releases, which served TPU only, is gone; checked: it does not
import), so the search is our own and deliberately small. It runs at the model's first forward
(the first input gives the tokens per step):

- Candidates. Each ``nn.Linear`` may stay replicated (``dp``), split its output features
  (``col``: weight ``(mp, 1)``, bias ``(mp,)``) or its input features (``row``: weight
  ``(1, mp)``); each ``nn.Embedding`` may split its vocabulary (``row``: ``(mp, 1)``) or its
  hidden size (``col``: ``(1, mp)``), over ``mp`` model-parallel devices, ``mp`` a divisor of
  the device count. Layers with a user strategy (``shard()``), parameters shared by several
  layers (tied embeddings) and everything else stay as the user left them (replicated).
- Memory per device: ``state_factor`` (4: fp32 weight, gradient and AdamW's two moments) times
  each parameter's bytes divided by its slices.
- Communication per device per step (ring estimates, bytes): the gradient all-reduce of each
  parameter over its replicas, ``2 (r - 1) / r x bytes / slices``; forward plus backward, a
  ``col`` layer gathers its output (``(mp - 1) / mp x tokens x features x 4``), unless the next
  layer is a ``row`` layer that takes the split features as they are (Megatron's pair); a
  ``row`` layer all-reduces its partial output (``2 (mp - 1) / mp x ...``). Tokens are per data
  parallel slice.
- Search. For each ``mp`` a dynamic program over the layers in module order (the state is the
  previous layer's choice, for the pair) minimises communication plus ``lambda`` x memory;
  ``lambda`` is raised from 0 until the plan fits ``device_memory_budget`` (the Lagrangian of
  the budget). The plan with the least communication that fits wins, ties to the smaller
  ``mp``; if none fits, a ``ValueError`` gives the smallest per-device footprint found.
"""

from __future__ import annotations

import math

import torch

from torchacc.parallel import context
from torchacc.parallel.module import model_parallel_size, shard
from torchacc.parallel.ops import Primitive

STATE_FACTOR = 4
_LAMBDAS = [0.0] + [10.0**k for k in range(-4, 7)]


class _Layer:
    def __init__(self, name, module):
        self.name, self.module = name, module
        self.kind = "linear" if isinstance(module, torch.nn.Linear) else "embedding"
        w = module.weight
        self.shape = tuple(w.shape)
        self.bytes = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        self.features = self.shape[0] if self.kind == "linear" else self.shape[1]  # output

    def options(self, mp):
        out = ["dp"]
        if mp == 1:
            return out
        if self.kind == "linear":
            rows, cols = self.shape
            if rows % mp == 0:
                out.append("col")
            if cols % mp == 0:
                out.append("row")
        else:
            if self.shape[0] % mp == 0:
                out.append("row")
            if self.shape[1] % mp == 0:
                out.append("col")
        return out

    def plan(self, choice, mp):
        if choice == "dp":
            return {}
        m = self.module
        if self.kind == "linear":
            w = (mp, 1) if choice == "col" else (1, mp)
            plan = {"weight": w}
            if m.bias is not None and choice == "col":
                plan["bias"] = (mp,)
            return plan
        return {"weight": (mp, 1) if choice == "row" else (1, mp)}

    def memory(self, choice, mp):
        if choice == "dp":
            return STATE_FACTOR * self.bytes
        w = self.module.weight
        wb = w.numel() * w.element_size()
        rest = self.bytes - wb
        bias_split = choice == "col" and self.kind == "linear"
        return STATE_FACTOR * (wb / mp + (rest / mp if bias_split else rest))

    def comm(self, choice, prev, prev_layer, n, mp, tokens):
        slices = 1 if choice == "dp" else mp
        replicas = n // slices
        grad = 2 * (replicas - 1) / replicas * self.bytes / slices
        act = tokens / (n // mp) * self.features * 4
        if choice == "dp":
            return grad
        if choice == "row":
            return grad + 2 * 2 * (mp - 1) / mp * act
        return grad + 2 * (mp - 1) / mp * act  # col: gather (refunded by a following row)

    def pair_refund(self, choice, prev, prev_layer, n, mp, tokens):
        """A row layer right after a col layer whose output it consumes: no gather between."""
        if (
            choice == "row"
            and prev == "col"
            and prev_layer.kind == "linear"
            and self.kind == "linear"
            and prev_layer.shape[0] == self.shape[1]
        ):
            return 2 * (mp - 1) / mp * tokens / (n // mp) * prev_layer.features * 4
        return 0.0


def _candidates(model):
    counts: dict = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    layers, skipped = [], {}
    for name, m in model.named_modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        plan = getattr(m, "_torchacc_shard", None)
        if plan is not None and not plan.by_search:
            skipped[name] = "user strategy (shard())"
        elif any(counts[id(p)] > 1 for p in m.parameters(recurse=False)):
            skipped[name] = "parameter shared with another layer"
        else:
            layers.append(_Layer(name, m))
    return layers, skipped


def _chain(layers, n, mp, tokens, lam):
    """Minimum of communication + lam x memory over the layer chain; returns (choices, comm,
    memory)."""
    best = {None: (0.0, 0.0, 0.0, [])}  # prev choice -> (objective, comm, memory, choices)
    prev_layer = None
    for layer in layers:
        nxt = {}
        for choice in layer.options(mp):
            for prev, (obj, comm, mem, picks) in best.items():
                c = layer.comm(choice, prev, prev_layer, n, mp, tokens)
                if prev_layer is not None:
                    c -= layer.pair_refund(choice, prev, prev_layer, n, mp, tokens)
                m = layer.memory(choice, mp)
                cand = (obj + c + lam * m, comm + c, mem + m, picks + [choice])
                if choice not in nxt or cand[0] < nxt[choice][0]:
                    nxt[choice] = cand
        best, prev_layer = nxt, layer
    obj, comm, mem, picks = min(best.values(), key=lambda v: v[0])
    return picks, comm, mem


def _tokens(args):
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.numel() // t.shape[-1] if t.is_floating_point() else t.numel()
    return 1


def search(model, args):
    """Choose and apply strategies for ``model``'s layers (Note [The auto-parallel search]);
    fixes the device matrix and records the strategy table."""
    n = context.get_group_size()
    budget = context.option("device_memory_budget")
    tokens = _tokens(args)
    layers, skipped = _candidates(model)
    others = STATE_FACTOR * sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if not any(p is q for layer in layers for q in layer.module.parameters(recurse=False))
    )
    user_mp = model_parallel_size(model)
    found, smallest = None, None
    for mp in [d for d in range(1, n + 1) if n % d == 0]:
        if n % math.lcm(mp, user_mp):
            continue
        for lam in _LAMBDAS:
            picks, comm, mem = _chain(layers, n, mp, tokens, lam)
            total = mem + others
            if smallest is None or total < smallest[0]:
                smallest = (total, mp)
            if budget is None or total <= budget:
                if found is None or comm < found[1] - 1e-9:
                    found = (mp, comm, total, picks)
                break
    if found is None:
        raise ValueError(
            f"AUTO_PARALLEL: no layout of the model's Linear/Embedding layers fits "
            f"device_memory_budget={budget} bytes per device; the smallest found needs "
            f"{smallest[0]:.0f} bytes (model parallel {smallest[1]} of {n} devices, "
            f"{STATE_FACTOR} x parameter bytes for weights, gradients and AdamW state)"
        )
    mp, comm, total, picks = found
    for layer, choice in zip(layers, picks):
        if choice != "dp":
            shard(layer.module, None, parameter_plan=layer.plan(choice, mp), _by_search=True)
    matrix = context.device_matrix(math.lcm(mp, user_mp))
    replicated = others + sum(layer.memory("dp", 1) for layer in layers)
    rows = []
    for layer, choice in zip(layers, picks):
        why = {
            "dp": "replicated: cheapest in communication",
            "col": "output features split",
            "row": "input features split",
        }[choice]
        if layer.kind == "embedding":
            why = {"row": "vocabulary split", "col": "hidden size split"}.get(choice, why)
        rows.append((layer.name, layer.shape, choice, layer.plan(choice, mp), why))
    for name, why in skipped.items():
        rows.append((name, tuple(model.get_submodule(name).weight.shape), "kept", {}, why))
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, Primitive) and v.strategy is not None:
                rows.append((v.name, (), "op", v.strategy, "user op strategy (.shard())"))
    model._torchacc_strategy_table = {
        "matrix": matrix,
        "budget": budget,
        "estimate": total,
        "replicated": replicated,
        "comm": comm,
        "tokens": tokens,
        "rows": rows,
    }
    print(strategy_table(model), flush=True)


def strategy_table(model):
    """The strategies the AUTO_PARALLEL search chose for ``model``, one line per layer, and why."""
    t = getattr(model, "_torchacc_strategy_table", None)
    if t is None:
        raise ValueError(
            "strategy_table: the model has no searched strategies; call parallelize(model) under "
            "AUTO_PARALLEL and run its first forward"
        )
    budget = "none" if t["budget"] is None else f"{t['budget']} B"
    lines = [
        f"AUTO_PARALLEL on {t['matrix']}: {t['tokens']} tokens/step, per-device memory estimate "
        f"{t['estimate']:.0f} B (replicated model: {t['replicated']:.0f} B; budget {budget}; "
        f"weights + grads + AdamW state), communication estimate {t['comm']:.0f} B/step",
    ]
    if t["budget"] is not None and t["replicated"] > t["budget"]:
        lines.append(
            f"  pure data parallel needs {t['replicated']:.0f} B per device > budget: layers split"
        )
    for name, shape, choice, plan, why in t["rows"]:
        lines.append(f"  {name:<28} {str(shape):<14} {choice:<4} {str(plan):<32} {why}")
    return "\n".join(lines)
