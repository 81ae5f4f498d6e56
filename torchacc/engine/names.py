"""Names of a graph's inputs in the user's words: ``model.fc.weight``, ``x``, ``batch[0]``.

Note [Naming graph inputs]
Only a compile (or a debug message) asks for names, so they are found then, never while recording:
no map is kept per op or per parameter. The names come from the user's frames on the stack at that
moment (Note [Trigger sites] in sites.py), innermost first: an ``nn.Module`` in a local or global
variable names its parameters, buffers and their ``.grad`` (``model.fc.weight``), an optimizer its
state (``opt.state[model.fc.weight]['exp_avg']``), a tensor variable itself (``x``), a list, tuple
or dict variable its tensor items (``batch[0]``), and one attribute level of other objects
(``self.model.fc.weight``). Module names are taken from the outermost frame that has the module,
so a read inside ``forward`` still says ``model.fc.weight`` rather than ``self.weight``.

A name belongs to a Storage. A graph input is the Value a storage held when the step began; if the
step wrote the storage (an optimizer update), its current Value is pending, and the input is found
by walking back from it through the nodes that produced it: output ``i`` of an update node is the
new value of its input ``i`` (in-place twins, ``_foreach_*``, ``_fused_adamw``), else the only input
of the same shape and dtype. Inputs no name reaches are ``batch input k`` (numbered in graph order).
"""

from __future__ import annotations

import torch

from torchacc.engine.sites import _is_internal, main_thread_frame
from torchacc.ir import live_storages

extra_namers: list = []  # callbacks () -> {id(storage): name} (the lazy frontend's RNG state)
_MAX_LOCALS = 512


def _storage(t):
    return getattr(t, "_st", None)


def _user_frames(frame):
    """The user's frames from ``frame`` outward (innermost first)."""
    frame = frame if frame is not None else main_thread_frame()
    frames = []
    while frame is not None:
        if not _is_internal(frame.f_code):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _scopes(frames):
    """``(variable, object)`` pairs of the frames' locals then globals, innermost first."""
    seen = set()
    for frame in frames:
        for scope in (frame.f_locals, frame.f_globals):
            if id(scope) in seen:
                continue
            seen.add(id(scope))
            for i, item in enumerate(list(scope.items())):
                if i >= _MAX_LOCALS:
                    break
                if not item[0].startswith("__"):
                    yield item


def _modules_and_optimizers(pairs):
    """Modules and optimizers among ``pairs``, directly or one attribute deep."""
    found = []
    for var, obj in pairs:
        if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            found.append((var, obj))
        elif not isinstance(obj, type) and type(obj).__module__ != "builtins":
            try:  # a user object's __dict__ (a proxy may refuse: then it has no names to give)
                attrs = list(vars(obj).items())[:_MAX_LOCALS]
            except Exception:
                continue
            for attr, sub in attrs:
                if isinstance(sub, (torch.nn.Module, torch.optim.Optimizer)):
                    found.append((f"{var}.{attr}", sub))
    return found


def _tensor_names(pairs, add):
    for var, obj in pairs:
        if isinstance(obj, torch.Tensor):
            add(obj, var)
        elif isinstance(obj, (list, tuple)) and len(obj) <= _MAX_LOCALS:
            for i, t in enumerate(obj):
                if isinstance(t, torch.Tensor):
                    add(t, f"{var}[{i}]")
        elif isinstance(obj, dict) and len(obj) <= _MAX_LOCALS:
            for k, t in list(obj.items()):
                if isinstance(t, torch.Tensor):
                    add(t, f"{var}[{k!r}]")


def storage_names(frame):
    """``{id(storage): (storage, name)}`` for every storage the user's variables reach."""
    names: dict = {}

    def add(t, name):
        st = _storage(t)
        if st is not None and id(st) not in names:
            names[id(st)] = (st, name)

    pairs = list(_scopes(_user_frames(frame)))
    holders = _modules_and_optimizers(pairs)
    param_names = {}
    for var, mod in reversed(holders):  # outermost frame first: full module paths
        if isinstance(mod, torch.nn.Module):
            for name, p in mod.named_parameters():
                param_names.setdefault(id(p), f"{var}.{name}")
            for name, b in mod.named_buffers():
                add(b, f"{var}.{name}")
    for _, mod in holders:
        if isinstance(mod, torch.nn.Module):
            for p in mod.parameters():
                add(p, param_names[id(p)])
                if p.grad is not None:
                    add(p.grad, f"{param_names[id(p)]}.grad")
    for var, opt in holders:
        if isinstance(opt, torch.optim.Optimizer):
            for i, (p, state) in enumerate(list(opt.state.items())):
                pname = param_names.get(id(p), f"param {i}")
                for k, t in state.items():
                    if isinstance(t, torch.Tensor):
                        add(t, f"{var}.state[{pname}][{k!r}]")
    _tensor_names(pairs, add)
    for namer in extra_namers:
        for key, entry in namer().items():
            names.setdefault(key, entry)
    return names


def _origin(value, limit=100_000):
    """The graph input (a computed Value) that pending ``value`` is the new version of, or None."""
    aval = (value.desc[0], value.desc[2])
    for _ in range(limit):
        node = value.node
        if node is None:
            return value
        ins = node.inputs
        nxt = ins[value.index] if value.index < len(ins) else None
        if nxt is None or (nxt.desc[0], nxt.desc[2]) != aval:
            same = [v for v in ins if (v.desc[0], v.desc[2]) == aval]
            if len({id(v) for v in same}) != 1:
                return None
            nxt = same[0]
        value = nxt
    return None


def input_names(inputs, frame):
    """A name for each graph input Value in ``inputs`` (Note [Naming graph inputs])."""
    named = storage_names(frame)
    by_value = {}
    for st in live_storages():
        entry = named.get(id(st))
        if entry is None:
            continue
        v = st.value
        origin = v if v.node is None else _origin(v)
        if origin is not None:
            by_value.setdefault(id(origin), entry[1])
    out, unnamed = [], 0
    for v in inputs:
        name = by_value.get(id(v))
        if name is None:
            name = f"batch input {unnamed}"
            unnamed += 1
        out.append(name)
    return out
