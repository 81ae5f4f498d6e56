"""NN lowering rules (torchacc/lowering/nn.py, nn_backward.py) against eager PyTorch on CPU:
matmuls, convolution, pooling, normalization, softmax. Losses/embedding/dropout/upsampling are in
test_lowering_nn_loss.py, attention in test_lowering_nn_attention.py.

``check_opt`` (below) extends the harness's check_rule to ops whose outputs can be None (backward
ops with an output_mask), to outputs where the meta kernel and the CPU kernel disagree on shape
(``skip=``), and to tensor keyword arguments. The harness drops None outputs positionally, which
misaligns (None, t, t), and does not convert tensors passed as keywords.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from lowering_harness import _map, _scalar_array, check_rule, to_jax, to_numpy

from torchacc.lowering import lookup
from torchacc.lowering.dtypes import jdtype
from torchacc.lowering.registry import scalar_arguments

aten = torch.ops.aten
BF16 = dict(rtol=1.6e-2, atol=1.6e-2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, dtype=torch.float32, scale=1.0):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return (torch.randn(shape) * scale).to(dtype)


def _to_meta(t):
    return t.to("meta")


def run_opt(op, *args, rng_seed=0, **kwargs):
    """Like lowering_harness.run_rule, keeping None outputs in place. Returns (outs, metas)."""
    rule = lookup(op)
    assert rule is not None, f"no lowering rule for {op}"
    args = list(args)
    dyn = {}
    for name, (pos, is_list) in scalar_arguments(op, rule.static).items():
        if pos is not None and pos < len(args):
            where, key, value = "a", pos, args[pos]
        elif name in kwargs:
            where, key, value = "k", name, kwargs[name]
        else:
            continue
        if value is None or isinstance(value, torch.Tensor):
            continue
        dyn[(where, key)] = [_scalar_array(v) for v in value] if is_list else _scalar_array(value)
    # (the harness's _map leaves tensors inside the kwargs dict unconverted; map values here)
    meta = op(*_map(args, _to_meta), **{n: _map(v, _to_meta) for n, v in kwargs.items()})
    metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
    jargs, jkwargs = _map(args, to_jax), {n: _map(v, to_jax) for n, v in kwargs.items()}

    def fn(dyn_values):
        a, k = list(jargs), dict(jkwargs)
        for (where, key), v in dyn_values.items():
            (a if where == "a" else k)[key] = v
        extra = {"rng": jax.random.key(rng_seed)} if rule.rng else {}
        return rule.fn(*a, **k, **extra)

    out = jax.jit(fn)(dyn)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    assert len(outs) == len(metas), f"{op}: {len(outs)} outputs, meta gives {len(metas)}"
    results = []
    for o, m in zip(outs, metas, strict=True):
        if not isinstance(m, torch.Tensor):
            assert o is None, f"{op}: rule gave an output where torch gives {m}"
            results.append(None)
            continue
        assert o is not None, f"{op}: rule gave None where torch gives a tensor"
        o = jnp.asarray(o).astype(jdtype(m.dtype))
        assert o.shape == tuple(m.shape), f"{op}: rule gave shape {o.shape}, meta {m.shape}"
        results.append(to_numpy(o))
    return results, metas


def check_opt(op, *args, rtol=1e-5, atol=1e-6, skip=(), **kwargs):
    """check_rule that allows None outputs; outputs listed in ``skip`` are only shape-checked."""
    expected = op(*args, **kwargs)
    exp = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    got, _ = run_opt(op, *args, **kwargs)
    assert len(got) == len(exp)
    for i, (g, e) in enumerate(zip(got, exp, strict=True)):
        if i in skip or e is None:
            assert (g is None) == (e is None) or i in skip, (op, i)
            continue
        e_np = e.detach().float().numpy() if e.dtype == torch.bfloat16 else e.detach().numpy()
        np.testing.assert_allclose(g, e_np, rtol=rtol, atol=atol, err_msg=f"{op} output {i}")
    return got


# -------------------------------------------------------------------------------------------------
# matmul family

MATMUL = {
    "mm": lambda d: (aten.mm.default, (randn(5, 7, dtype=d), randn(7, 3, dtype=d)), {}),
    "bmm": lambda d: (aten.bmm.default, (randn(2, 5, 7, dtype=d), randn(2, 7, 3, dtype=d)), {}),
    "mv": lambda d: (aten.mv.default, (randn(5, 7, dtype=d), randn(7, dtype=d)), {}),
    "dot": lambda d: (aten.dot.default, (randn(9, dtype=d), randn(9, dtype=d)), {}),
    "addmm": lambda d: (
        aten.addmm.default,
        (randn(3, dtype=d), randn(5, 7, dtype=d), randn(7, 3, dtype=d)),
        {},
    ),
    "addmm_ab": lambda d: (
        aten.addmm.default,
        (randn(5, 3, dtype=d), randn(5, 7, dtype=d), randn(7, 3, dtype=d)),
        dict(beta=0.5, alpha=2.0),
    ),
    "baddbmm": lambda d: (
        aten.baddbmm.default,
        (randn(2, 5, 3, dtype=d), randn(2, 5, 7, dtype=d), randn(2, 7, 3, dtype=d)),
        dict(alpha=0.5),
    ),
    "addbmm": lambda d: (
        aten.addbmm.default,
        (randn(5, 3, dtype=d), randn(2, 5, 7, dtype=d), randn(2, 7, 3, dtype=d)),
        dict(beta=2),
    ),
    "addmv": lambda d: (
        aten.addmv.default,
        (randn(5, dtype=d), randn(5, 7, dtype=d), randn(7, dtype=d)),
        dict(beta=-1.0),
    ),
    "addmm_relu": lambda d: (
        aten._addmm_activation.default,
        (randn(3, dtype=d), randn(5, 7, dtype=d), randn(7, 3, dtype=d)),
        {},
    ),
    "addmm_gelu": lambda d: (
        aten._addmm_activation.default,
        (randn(3, dtype=d), randn(5, 7, dtype=d), randn(7, 3, dtype=d)),
        dict(use_gelu=True),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(MATMUL))
def test_matmul(name, dtype):
    op, args, kwargs = MATMUL[name](dtype)
    tol = BF16 if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    check_rule(op, *args, **tol, **kwargs)


def test_addmm_beta_zero_ignores_nan_and_vdot():
    self = torch.full((5, 3), float("nan"))
    check_rule(aten.addmm.default, self, randn(5, 7), randn(7, 3), beta=0)
    check_rule(aten.vdot.default, randn(6), randn(6), rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# convolution cases: (input shape, weight shape, bias?, stride, padding, dilation, transposed,
# output_padding, groups)

CONV = {
    "1d_grouped": ((2, 4, 11), (6, 2, 3), True, [2], [1], [2], False, [0], 2),
    "2d_nobias": ((2, 3, 7, 6), (4, 3, 3, 2), False, [1, 2], [1, 0], [1, 1], False, [0, 0], 1),
    "2d_depthwise": ((1, 4, 6, 6), (4, 1, 3, 3), True, [1, 1], [2, 2], [2, 2], False, [0, 0], 4),
    "3d": (
        (1, 2, 4, 5, 4),
        (3, 2, 2, 3, 2),
        True,
        [1, 2, 1],
        [0, 1, 1],
        [1, 1, 1],
        False,
        [0] * 3,
        1,
    ),
    "t2d": ((2, 4, 5, 4), (4, 3, 3, 3), True, [2, 2], [1, 0], [1, 1], True, [1, 0], 1),
    "t2d_grouped": ((1, 4, 4, 5), (4, 1, 3, 2), False, [2, 1], [0, 1], [2, 1], True, [1, 0], 2),
    "t1d": ((2, 3, 6), (3, 2, 4), True, [3], [2], [1], True, [2], 1),
}


def _conv_args(name, dtype):
    xs, ws, has_bias, stride, pad, dil, tr, opad, groups = CONV[name]
    x, w = randn(*xs, dtype=dtype), randn(*ws, dtype=dtype, scale=0.5)
    cout = ws[1] * groups if tr else ws[0]
    b = randn(cout, dtype=dtype) if has_bias else None
    return x, w, b, stride, pad, dil, tr, opad, groups


@pytest.mark.parametrize("name", list(CONV))
def test_convolution(name):
    args = _conv_args(name, torch.float32)
    check_rule(aten.convolution.default, *args, rtol=1e-5, atol=1e-5)
    if name == "t2d":
        flags = (False, True, True, True)  # benchmark, deterministic, cudnn_enabled, allow_tf32
        check_rule(aten._convolution.default, *args, *flags, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["2d_nobias", "t2d"])
def test_convolution_bf16(name):
    check_rule(aten.convolution.default, *_conv_args(name, torch.bfloat16), **BF16)


@pytest.mark.parametrize(
    "name,mask",
    [
        ("1d_grouped", [True, True, True]),
        ("2d_nobias", [True, True, False]),
        ("2d_depthwise", [False, True, True]),
        ("3d", [True, False, True]),
        ("t2d", [True, True, True]),
        ("t2d_grouped", [True, True, False]),
        ("t1d", [False, True, True]),
    ],
)
def test_convolution_backward(name, mask):
    x, w, b, stride, pad, dil, tr, opad, groups = _conv_args(name, torch.float32)
    y = aten.convolution.default(x, w, b, stride, pad, dil, tr, opad, groups)
    bias_sizes = [b.shape[0]] if b is not None else None
    args = (randn(*y.shape), x, w, bias_sizes, stride, pad, dil, tr, opad, groups, mask)
    check_opt(aten.convolution_backward.default, *args, rtol=1e-4, atol=1e-4)


def test_convolution_backward_bf16():
    x, w, b, stride, pad, dil, tr, opad, groups = _conv_args("2d_depthwise", torch.bfloat16)
    y = aten.convolution.default(x, w, b, stride, pad, dil, tr, opad, groups)
    args = (randn(*y.shape, dtype=torch.bfloat16), x, w, [4], stride, pad, dil, tr, opad, groups)
    check_opt(aten.convolution_backward.default, *args, [True, True, True], rtol=2e-2, atol=5e-2)


# -------------------------------------------------------------------------------------------------
# pooling

MAXPOOL = {
    "k2": ((2, 3, 6, 6), [2], [], [0], [1], False),
    "k3s2p1_ceil": ((2, 2, 7, 8), [3, 3], [2, 2], [1, 1], [1, 1], True),
    "dil_3d": ((3, 9, 8), [3, 2], [1, 2], [1, 0], [2, 2], False),
    "ceil_overhang": ((1, 2, 5, 5), [2, 2], [2, 2], [0, 0], [1, 1], True),
}


@pytest.mark.parametrize("name", list(MAXPOOL))
def test_max_pool2d_with_indices(name):
    shape, *rest = MAXPOOL[name]
    x = randn(*shape)
    if name == "k3s2p1_ceil":
        x[0, 0, :3, :3] = -float("inf")  # a window of -inf must still index a real element
    check_rule(aten.max_pool2d_with_indices.default, x, *rest)
    out, idx = aten.max_pool2d_with_indices.default(x, *rest)
    check_rule(aten.max_pool2d_with_indices_backward.default, randn(*out.shape), x, *rest, idx)


AVGPOOL = {
    "k2": ((2, 3, 6, 6), [2, 2], [], [0, 0], False, True, None),
    "ceil_nopad_count": ((2, 2, 7, 7), [3, 3], [2, 2], [1, 1], True, False, None),
    "ceil_pad_count": ((1, 2, 7, 8), [3, 2], [2, 3], [1, 1], True, True, None),
    "divisor_3d": ((3, 5, 6), [2, 3], [1, 2], [1, 1], False, True, 5),
}


@pytest.mark.parametrize("name", list(AVGPOOL))
def test_avg_pool2d(name):
    shape, *rest = AVGPOOL[name]
    x = randn(*shape)
    check_rule(aten.avg_pool2d.default, x, *rest)
    out = aten.avg_pool2d.default(x, *rest)
    check_rule(aten.avg_pool2d_backward.default, randn(*out.shape), x, *rest)


def test_avg_pool2d_bf16():
    check_rule(
        aten.avg_pool2d.default, randn(2, 3, 6, 6, dtype=torch.bfloat16), [3, 3], [2, 2], **BF16
    )


@pytest.mark.parametrize(
    "shape,out", [((2, 3, 7, 9), [3, 4]), ((3, 8, 6), [4, 3]), ((1, 2, 5, 5), [5, 7])]
)
def test_adaptive_pools(shape, out):
    x = randn(*shape)
    check_rule(aten._adaptive_avg_pool2d.default, x, out)
    y = aten._adaptive_avg_pool2d.default(x, out)
    check_rule(aten._adaptive_avg_pool2d_backward.default, randn(*y.shape), x)
    check_rule(aten.adaptive_max_pool2d.default, x, out)
    y, idx = aten.adaptive_max_pool2d.default(x, out)
    check_rule(aten.adaptive_max_pool2d_backward.default, randn(*y.shape), x, idx)


# -------------------------------------------------------------------------------------------------
# batch norm family


def _bn_inputs(shape=(4, 3, 5, 2), affine=True):
    c = shape[1]
    x = randn(*shape) * 2 + 1
    w, b = (randn(c), randn(c)) if affine else (None, None)
    return x, w, b, randn(c) * 0.1, torch.rand(c) + 0.5


@pytest.mark.parametrize("shape", [(4, 3, 5, 2), (6, 3)])
@pytest.mark.parametrize("training", [True, False])
def test_native_batch_norm(shape, training):
    x, w, b, rm, rv = _bn_inputs(shape)
    skip = () if training else (1, 2)  # eval: CPU gives empty save_* where meta gives (C,)
    check_opt(aten.native_batch_norm.default, x, w, b, rm, rv, training, 0.1, 1e-5, skip=skip)


def test_native_batch_norm_no_running_stats_and_bf16():
    x, _, _, _, _ = _bn_inputs(affine=False)
    check_opt(aten.native_batch_norm.default, x, None, None, None, None, True, 0.1, 1e-5)
    x, w, b, rm, rv = _bn_inputs()
    xb = x.bfloat16()
    check_opt(aten.native_batch_norm.default, xb, w, b, rm, rv, True, 0.1, 1e-5, **BF16)


@pytest.mark.parametrize("training", [True, False])
def test_native_batch_norm_legit_functional(training):
    x, w, b, rm, rv = _bn_inputs()
    skip = () if training else (1, 2)
    op = aten._native_batch_norm_legit_functional.default
    got = check_opt(op, x, w, b, rm, rv, training, 0.3, 1e-3, skip=skip, rtol=1e-5, atol=1e-5)
    # eager updates the running stats in place on the mutating overload; compare with that
    rm2, rv2 = rm.clone(), rv.clone()
    aten._native_batch_norm_legit.default(x, w, b, rm2, rv2, training, 0.3, 1e-3)
    np.testing.assert_allclose(got[3], rm2.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[4], rv2.numpy(), rtol=1e-5, atol=1e-6)


def test_batch_norm_other_overloads():
    x, w, b, rm, rv = _bn_inputs()
    check_opt(aten._native_batch_norm_legit.no_stats, x, w, b, True, 0.1, 1e-5)
    check_opt(
        aten._native_batch_norm_legit_no_training.default, x, w, b, rm, rv, 0.1, 1e-5, skip=(1, 2)
    )
    check_opt(aten._batch_norm_no_update.default, x, w, b, rm, rv, 0.1, 1e-5, skip=(1, 2))
    got = check_opt(aten._batch_norm_with_update_functional.default, x, w, b, rm, rv, 0.1, 1e-5)
    rm2, rv2 = rm.clone(), rv.clone()
    aten.native_batch_norm.default(x, w, b, rm2, rv2, True, 0.1, 1e-5)
    np.testing.assert_allclose(got[4], rm2.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[5], rv2.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "training,mask,affine",
    [
        (True, [True, True, True], True),
        (False, [True, True, True], True),
        (True, [True, False, False], False),
    ],
)
def test_native_batch_norm_backward(training, mask, affine):
    x, w, b, rm, rv = _bn_inputs(affine=affine)
    _, sm, si = aten.native_batch_norm.default(x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5)
    g = randn(*x.shape)
    args = (g, x, w, rm, rv, sm, si, training, 1e-5, mask)
    check_opt(aten.native_batch_norm_backward.default, *args, rtol=1e-4, atol=1e-5)
    if training and affine:
        reserve = torch.empty(0, dtype=torch.uint8)
        check_opt(aten.batch_norm_backward.default, *args, reserve, rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# layer norm, group norm


@pytest.mark.parametrize(
    "shape,ns,affine,dtype",
    [
        ((2, 3, 8), [8], True, torch.float32),
        ((2, 3, 4, 5), [4, 5], False, torch.float32),
        ((4, 16), [16], True, torch.bfloat16),
    ],
)
def test_native_layer_norm(shape, ns, affine, dtype):
    x = randn(*shape, dtype=dtype) * 3 + 1
    w = randn(*ns, dtype=dtype) if affine else None
    b = randn(*ns, dtype=dtype) if affine else None
    tol = BF16 if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    check_rule(aten.native_layer_norm.default, x, ns, w, b, 1e-5, **tol)
    _, mean, rstd = aten.native_layer_norm.default(x, ns, w, b, 1e-5)
    g = randn(*shape, dtype=dtype)
    mask = [True, affine, affine]
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    check_opt(aten.native_layer_norm_backward.default, g, x, ns, mean, rstd, w, b, mask, **tol)


@pytest.mark.parametrize("affine", [True, False])
def test_native_group_norm(affine):
    N, C, H, W, G = 2, 6, 3, 4, 3
    x = randn(N, C, H, W) * 2 + 0.5
    w, b = (randn(C), randn(C)) if affine else (None, None)
    check_rule(aten.native_group_norm.default, x, w, b, N, C, H * W, G, 1e-5, rtol=1e-5, atol=1e-5)
    _, mean, rstd = aten.native_group_norm.default(x, w, b, N, C, H * W, G, 1e-5)
    mask = [True, True, True] if affine else [True, False, False]
    args = (randn(N, C, H, W), x, mean, rstd, w, N, C, H * W, G, mask)
    check_opt(aten.native_group_norm_backward.default, *args, rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax(dim, dtype):
    x = randn(3, 5, 4, dtype=dtype, scale=3)
    tol = BF16 if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for fwd, bwd in (
        (aten._softmax.default, aten._softmax_backward_data.default),
        (aten._log_softmax.default, aten._log_softmax_backward_data.default),
    ):
        check_rule(fwd, x, dim, False, **tol)
        y = fwd(x, dim, False)
        check_rule(bwd, randn(*x.shape, dtype=dtype), y, dim, dtype, **tol)


def test_softmax_half_to_float_and_safe_softmax():
    x = randn(3, 4, dtype=torch.bfloat16)
    got, metas = run_opt(aten._softmax.default, x, -1, True)
    assert metas[0].dtype == torch.float32 and got[0].dtype == np.float32
    np.testing.assert_allclose(got[0], torch.softmax(x.float(), -1).numpy(), rtol=1e-6)
    x = randn(3, 4)
    x[1] = -float("inf")  # a fully masked row gives zeros, not nan
    check_rule(aten._safe_softmax.default, x, -1)
    check_rule(aten._safe_softmax.default, randn(2, 5), 0, torch.float64)


# torch 2.11 routes a PrivateUse1 convolution to the *_overrideable ops (no bias_sizes in the
# backward); called here directly on torchacc tensors, recorded (no fallback) and compared with
# eager aten.convolution / convolution_backward on CPU.
@pytest.mark.parametrize("name", ["2d_nobias", "1d_grouped", "t2d", "t2d_grouped"])
def test_convolution_overrideable_on_device(name):
    import torchacc

    dev = torchacc.device()
    x, w, b, stride, pad, dil, tr, opad, groups = _conv_args(name, torch.float32)
    conv_args = (stride, pad, dil, tr, opad, groups)
    want = aten.convolution.default(x, w, b, *conv_args)
    g = randn(*want.shape)
    mask = [True, True, b is not None]
    bias_sizes = [b.shape[0]] if b is not None else None
    want_grads = aten.convolution_backward.default(g, x, w, bias_sizes, *conv_args, mask)

    torchacc.metrics.clear_counters()
    d = lambda t: None if t is None else t.to(dev)  # noqa: E731
    got = aten.convolution_overrideable.default(d(x), d(w), d(b), *conv_args)
    got_grads = aten.convolution_backward_overrideable.default(d(g), d(x), d(w), *conv_args, mask)
    torchacc.sync()
    assert torchacc.metrics.executed_fallback_ops() == []
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    for i, (a, e) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert (a is None) == (e is None), i
        if e is not None:
            torch.testing.assert_close(a.cpu(), e, rtol=1e-4, atol=1e-4, msg=f"grad {i}")
