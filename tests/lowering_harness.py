"""Check one lowering rule against the eager PyTorch op on CPU.

``check_rule(op, *args, **kwargs)`` runs ``op`` eagerly on CPU tensors, then the registered rule
under ``jax.jit`` following the calling convention of torchacc/lowering/registry.py (tensors as jax
arrays, Scalar/float arguments as traced 0-d arrays unless the rule keeps them static), casts to the
meta dtype like the core does, and compares every output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchacc.lowering import lookup
from torchacc.lowering.dtypes import jdtype
from torchacc.lowering.registry import scalar_arguments


def to_jax(t):
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.detach().numpy())


def to_numpy(a):
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        a = a.astype(np.float32)
    return a


def _map(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):  # keyword arguments
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _scalar_array(v):
    if isinstance(v, bool):
        return jnp.asarray(v)
    if isinstance(v, int):
        return jnp.asarray(v, jnp.int64)
    return jnp.asarray(v, jnp.float64)


def run_rule(op, *args, rng_seed=0, **kwargs):
    """Run the rule for ``op`` on CPU torch inputs; returns a list of numpy outputs."""
    rule = lookup(op)
    assert rule is not None, f"no lowering rule for {op}"
    lifted = scalar_arguments(op, rule.static)
    args = list(args)
    dyn = {}  # (where, key) -> value to trace
    for name, (pos, is_list) in lifted.items():
        if pos is not None and pos < len(args):
            where, key = "a", pos
            value = args[pos]
        elif name in kwargs:
            where, key, value = "k", name, kwargs[name]
        else:
            continue
        if value is None or isinstance(value, torch.Tensor):
            continue
        dyn[(where, key)] = [_scalar_array(v) for v in value] if is_list else _scalar_array(value)

    meta_out = op(*_map(args, lambda t: t.to("meta")), **_map(kwargs, lambda t: t.to("meta")))
    metas = list(meta_out) if isinstance(meta_out, (list, tuple)) else [meta_out]
    out_avals = [(tuple(m.shape), jdtype(m.dtype)) for m in metas if isinstance(m, torch.Tensor)]

    jargs = _map(args, to_jax)
    jkwargs = _map(kwargs, to_jax)

    def fn(dyn_values):
        a, k = list(jargs), dict(jkwargs)
        for (where, key), v in dyn_values.items():
            (a if where == "a" else k)[key] = v
        extra = {}
        if rule.out_meta:
            extra["out"] = out_avals
        if rule.rng:
            extra["rng"] = jax.random.key(rng_seed)
        return rule.fn(*a, **k, **extra)

    out = jax.jit(fn)(dyn)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    results = []
    for o, (shape, dtype) in zip(outs, out_avals):
        o = jnp.asarray(o).astype(dtype)
        assert o.shape == shape, f"{op}: rule gave shape {o.shape}, torch gives {shape}"
        results.append(to_numpy(o))
    return results


def check_rule(op, *args, rtol=1e-5, atol=1e-6, signed_zeros=False, **kwargs):
    """Assert the rule for ``op`` matches eager CPU PyTorch on these inputs.

    NaN must match NaN and infinities match exactly (``assert_allclose``); with ``signed_zeros``
    a ``-0.0`` must also be ``-0.0`` (``assert_allclose`` treats the two zeros as equal)."""
    expected = op(*args, **kwargs)
    exp = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    exp = [e for e in exp if isinstance(e, torch.Tensor)]
    got = run_rule(op, *args, **kwargs)
    assert len(got) == len(exp), f"{op}: {len(got)} outputs, torch gives {len(exp)}"
    for i, (g, e) in enumerate(zip(got, exp)):
        e_np = e.detach().float().numpy() if e.dtype == torch.bfloat16 else e.detach().numpy()
        assert g.dtype == e_np.dtype or e.dtype == torch.bfloat16, (op, i, g.dtype, e_np.dtype)
        np.testing.assert_allclose(g, e_np, rtol=rtol, atol=atol, err_msg=f"{op} output {i}")
        if signed_zeros and g.dtype.kind == "f":
            zero = (g == 0) & (e_np == 0)
            np.testing.assert_array_equal(
                np.signbit(g)[zero], np.signbit(e_np)[zero], err_msg=f"{op} {i}: sign of 0"
            )
    return got
