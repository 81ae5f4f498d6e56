"""Lowering rules at the edges of their domains, against eager PyTorch on CPU: zeros of both
signs, infinities, NaN, ties (max/argmax/sort/topk pick the index torch picks), empty and size-1
dimensions, integer wrap-around, and gradients exactly at the kinks (ReLU at 0, clamp at its
bounds). Random inputs (the other lowering tests) almost never land on these points."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_rule, run_rule

aten = torch.ops.aten
INF, NAN = math.inf, math.nan

# one of every special float value, and ordinary ones around them
SPECIAL = torch.tensor([0.0, -0.0, INF, -INF, NAN, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5, 3e38])
POS = torch.tensor([0.0, -0.0, INF, 1.0, 4.0, NAN])
TIES = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-0.0, 0.0, -1.0, 0.0]])
TIES_NAN = torch.tensor([[1.0, NAN, 3.0, NAN], [INF, INF, -INF, 0.0], [NAN, NAN, NAN, NAN]])
I32 = torch.tensor([2**31 - 1, -(2**31), -1, 0, 1], dtype=torch.int32)
I8 = torch.tensor([127, -128, -1, 0, 1], dtype=torch.int8)
I64 = torch.tensor([2**63 - 1, -(2**63), -1, 0, 1], dtype=torch.int64)


def case(op, *args, id=None, **kwargs):
    return pytest.param(op, args, kwargs, id=id or str(op).replace("aten.", ""))


UNARY = (
    [
        case(op, SPECIAL)
        for op in (
            aten.relu.default,
            aten.neg.default,
            aten.abs.default,
            aten.sign.default,
            aten.sgn.default,
            aten.signbit.default,
            aten.exp.default,
            aten.expm1.default,
            aten.tanh.default,
            aten.sigmoid.default,
            aten.silu.default,
            aten.floor.default,
            aten.ceil.default,
            aten.trunc.default,
            aten.round.default,
            aten.frac.default,
            aten.isnan.default,
            aten.isinf.default,
            aten.isposinf.default,
            aten.isneginf.default,
            aten.reciprocal.default,
            aten.erf.default,
            aten.atan.default,
            aten.sin.default,
            aten.hardsigmoid.default,
            aten.mish.default,
        )
    ]
    + [
        case(
            aten.hardswish.default, SPECIAL[:-1], id="hardswish"
        ),  # x*(x+3) overflows first in torch
    ]
    + [
        case(op, POS)
        for op in (
            aten.log.default,
            aten.log2.default,
            aten.log10.default,
            aten.log1p.default,
            aten.sqrt.default,
            aten.rsqrt.default,
            aten.lgamma.default,
            aten.digamma.default,
        )
    ]
)


@pytest.mark.parametrize("op, args, kwargs", UNARY)
def test_unary_special_values(op, args, kwargs):
    check_rule(op, *args, signed_zeros=True, **kwargs)


X = SPECIAL.view(1, -1)
Y = SPECIAL.view(-1, 1)  # every pair of special values
# Divisors stop short of 3e38: XLA rewrites a division by a broadcast operand into a
# multiplication by its reciprocal, and 1/3e38 is subnormal, flushed to 0 (XLA flushes denormals),
# so inf/3e38 gives NaN and 3e38/3e38 gives 0 there. Known XLA behaviour (torch_xla's too);
# ordinary divisors only see the rounding of the reciprocal (1 ulp).
YD = SPECIAL[:-1].view(-1, 1)
# IEEE 754 leaves the sign of max(-0.0, +0.0) open; torch and XLA pick differently
ZERO_SIGN_OPEN = ("maximum", "minimum", "fmax", "fmin", "clamp")

BINARY = [
    case(aten.add.Tensor, X, Y),
    case(aten.sub.Tensor, X, Y),
    case(aten.mul.Tensor, X, Y),
    case(aten.div.Tensor, X, YD),
    case(aten.div.Tensor_mode, X, YD, rounding_mode="floor", id="div_floor"),
    case(aten.div.Tensor_mode, X, YD, rounding_mode="trunc", id="div_trunc"),
    case(aten.remainder.Tensor, X, YD),
    case(aten.fmod.Tensor, X, YD),
    case(aten.pow.Tensor_Tensor, X, Y),
    case(aten.atan2.default, X, Y),
    case(aten.maximum.default, X, Y),
    case(aten.minimum.default, X, Y),
    case(aten.fmax.default, X, Y),
    case(aten.fmin.default, X, Y),
    case(aten.hypot.default, X, Y),
    case(aten.logaddexp.default, X, Y),
    case(aten.xlogy.Tensor, X, Y),
    case(aten.copysign.Tensor, X, Y) if hasattr(aten, "copysign") else None,
    case(aten.eq.Tensor, X, Y),
    case(aten.lt.Tensor, X, Y),
    case(aten.clamp.default, SPECIAL, -1.0, 1.0),
    case(aten.clamp.Tensor, X, Y, torch.tensor(1.0), id="clamp_tensor"),
    case(aten.nan_to_num.default, SPECIAL),
    case(aten.nan_to_num.default, SPECIAL, 0.5, 7.0, -7.0, id="nan_to_num_args"),
    case(aten.where.self, X > 0, X, Y),
]


@pytest.mark.parametrize("op, args, kwargs", [c for c in BINARY if c is not None])
def test_binary_special_values(op, args, kwargs):
    if op not in _rules():
        pytest.skip(f"{op} has no lowering (decomposed)")
    signed = not any(name in str(op) for name in ZERO_SIGN_OPEN)
    check_rule(op, *args, signed_zeros=signed, **kwargs)


def _rules():
    from torchacc.lowering import RULES

    return RULES


REDUCTIONS = [
    case(aten.max.default, TIES),
    case(aten.max.dim, TIES, 1),
    case(aten.min.dim, TIES, 1),
    case(aten.argmax.default, TIES, 1),
    case(aten.argmin.default, TIES, 1),
    case(aten.argmax.default, TIES),
    case(aten.max.dim, TIES_NAN, 1, id="max_dim_nan"),
    case(aten.min.dim, TIES_NAN, 1, id="min_dim_nan"),
    case(aten.argmax.default, TIES_NAN, 1, id="argmax_nan"),
    case(aten.argmin.default, TIES_NAN, 1, id="argmin_nan"),
    case(aten.amax.default, TIES_NAN, [1], id="amax_nan"),
    case(aten.amin.default, TIES_NAN, [1], id="amin_nan"),
    case(aten.max.default, TIES_NAN, id="max_nan"),
    case(aten.sort.stable, TIES, stable=True, dim=1),
    case(aten.sort.stable, TIES, stable=True, dim=1, descending=True, id="sort_desc"),
    case(aten.sort.stable, TIES_NAN, stable=True, dim=1, id="sort_nan"),
    case(aten.sort.stable, TIES_NAN, stable=True, dim=1, descending=True, id="sort_nan_desc"),
    case(aten.cummax.default, TIES_NAN, 1),
    case(aten.cummin.default, TIES_NAN, 1),
    case(aten.cumsum.default, TIES_NAN, 1),
    case(aten.logsumexp.default, TIES_NAN, [1]),
    case(aten.logsumexp.default, torch.full((2, 3), -INF), [1], id="logsumexp_all_-inf"),
    case(aten._softmax.default, torch.tensor([[0.0, -INF, 1.0], [-INF] * 3]), 1, False),
    case(aten._log_softmax.default, torch.tensor([[0.0, -INF, 1.0], [INF, 0.0, 0.0]]), 1, False),
    case(aten.sum.default, SPECIAL),
    case(aten.prod.default, torch.tensor([0.0, INF])),
    case(aten.mean.dim, TIES_NAN, [1]),
    case(aten.var.correction, torch.tensor([[1.0], [2.0]]), [1], correction=1, id="var_n1"),
    case(aten.std.correction, torch.tensor([[1.0, INF]]), [1], correction=1, id="std_inf"),
]


@pytest.mark.parametrize("op, args, kwargs", REDUCTIONS)
def test_reductions_ties_and_specials(op, args, kwargs):
    check_rule(op, *args, **kwargs)


def _check_topk(x, k, largest):
    """topk's values must be torch's; among equal values torch does not promise which index
    comes first (not even with sorted=True), so indices must only point at those values."""
    values, indices = run_rule(aten.topk.default, x, k, 1, largest)
    want = torch.topk(x, k, 1, largest)
    np.testing.assert_array_equal(values, want.values.numpy())  # NaN == NaN here
    np.testing.assert_array_equal(np.take_along_axis(x.numpy(), indices, 1), values)
    assert all(len(set(row)) == k for row in indices.tolist()), indices


@pytest.mark.parametrize("x", [TIES, TIES_NAN, torch.ones(3, 0)], ids=["ties", "nan", "empty"])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_ties_and_nan(x, largest):
    _check_topk(x, min(2, x.shape[1]), largest)


E = torch.empty(0, 3)
SHAPES = [
    case(aten.sum.dim_IntList, E, [0], id="sum_empty"),
    case(aten.prod.dim_int, E, 0, id="prod_empty"),
    case(aten.mean.dim, E, [0], id="mean_empty"),
    case(aten.amax.default, E, [1], id="amax_over_nonempty"),
    case(aten.any.dim, E > 0, 0, id="any_empty"),
    case(aten.all.dim, E > 0, 0, id="all_empty"),
    case(aten.cumsum.default, E, 0, id="cumsum_empty"),
    case(aten.mm.default, torch.ones(2, 0), torch.ones(0, 3), id="mm_k0"),
    case(aten.mm.default, torch.ones(0, 4), torch.ones(4, 3), id="mm_m0"),
    case(aten.cat.default, [E, torch.ones(2, 3)], id="cat_empty"),
    case(aten.sort.stable, E, stable=True, dim=0, id="sort_empty"),
    case(aten.add.Tensor, torch.ones(1, 3), torch.ones(4, 1), id="add_size1_bcast"),
    case(aten._softmax.default, torch.randn(3, 1), 1, False, id="softmax_size1"),
    case(aten._log_softmax.default, torch.randn(3, 1), 1, False, id="log_softmax_size1"),
    case(aten.var.correction, torch.randn(3, 1), [1], correction=0, id="var_size1"),
    case(aten.max.dim, torch.randn(3, 1), 1, id="max_dim_size1"),
    case(aten.squeeze.dims, torch.randn(1, 3, 1), [0, 2], id="squeeze_size1"),
    case(aten.index_select.default, torch.randn(3, 2), 0, torch.tensor([], dtype=torch.long)),
    case(aten.native_layer_norm.default, torch.randn(2, 1), [1], None, None, 1e-5, id="ln_size1"),
]


@pytest.mark.parametrize("op, args, kwargs", SHAPES)
def test_empty_and_size_one_dimensions(op, args, kwargs):
    check_rule(op, *args, **kwargs)


INTS = [
    case(aten.add.Tensor, I32, I32.flip(0), id="add_i32_wraps"),
    case(aten.sub.Tensor, I32, I32.flip(0), id="sub_i32_wraps"),
    case(aten.mul.Tensor, I32, I32.flip(0), id="mul_i32_wraps"),
    case(aten.mul.Tensor, I8, I8, id="mul_i8_wraps"),
    case(aten.add.Tensor, I64, I64.flip(0), id="add_i64_wraps"),
    case(aten.neg.default, I8, id="neg_i8_min"),
    case(aten.abs.default, I32, id="abs_i32_min"),
    case(aten.sum.default, I32, id="sum_i32_to_i64"),
    case(aten.cumsum.default, I8, 0, id="cumsum_i8_to_i64"),
    case(aten.remainder.Tensor, I32, torch.tensor([3, -3, 2, 5, -7], dtype=torch.int32)),
    case(aten.fmod.Tensor, I32, torch.tensor([3, -3, 2, 5, -7], dtype=torch.int32)),
    case(aten.floor_divide.default, I32, torch.tensor([3, -3, 2, 5, -7], dtype=torch.int32)),
    case(aten.div.Tensor_mode, I64, torch.tensor([3, -3, 2, 5, -7]), rounding_mode="trunc"),
    case(aten.bitwise_not.default, I8),
    case(aten.__rshift__.Scalar, I32, 1, id="rshift_arith"),
    case(aten.__lshift__.Scalar, I8, 1, id="lshift_i8"),
    case(aten.maximum.default, I64, I64.flip(0), id="maximum_i64"),
    case(aten._to_copy.default, I32, dtype=torch.int8, id="i32_to_i8_wraps"),
    case(aten._to_copy.default, torch.tensor([2.7, -2.7, -0.5]), dtype=torch.int32, id="f2i"),
]


@pytest.mark.parametrize("op, args, kwargs", INTS)
def test_integer_edges(op, args, kwargs):
    check_rule(op, *args, rtol=0, atol=0, **kwargs)


KINK = torch.tensor([-1.0, -0.0, 0.0, 0.5, 1.0, 2.0, -2.0])
G = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])

GRADIENTS = [
    case(aten.threshold_backward.default, G, KINK, 0.0, id="relu_grad_at_0"),
    case(aten.threshold_backward.default, G, KINK, 1.0, id="threshold_grad_at_1"),
    case(aten.hardtanh_backward.default, G, KINK, -1.0, 1.0, id="hardtanh_grad_at_bounds"),
    case(aten.leaky_relu_backward.default, G, KINK, 0.1, False, id="leaky_relu_grad_at_0"),
    case(aten.elu_backward.default, G, 1.0, 1.0, 1.0, False, KINK, id="elu_grad_at_0"),
    case(aten.gelu_backward.default, G, KINK, id="gelu_grad"),
    case(aten.silu_backward.default, G, KINK, id="silu_grad"),
    case(aten.hardswish_backward.default, G, torch.tensor([-3.0, 3.0, 0.0, -4, 4, 1, -1])),
    case(aten.hardsigmoid_backward.default, G, torch.tensor([-3.0, 3.0, 0.0, -4, 4, 1, -1])),
    case(aten.sigmoid_backward.default, G, torch.tensor([0.0, 1.0, 0.5, 0, 1, 0.25, 1])),
    case(aten.softplus_backward.default, G, KINK * 30, 1.0, 20.0, id="softplus_grad_threshold"),
    case(aten.smooth_l1_loss_backward.default, G, KINK, torch.zeros(7), 0, 1.0),
    case(aten.huber_loss_backward.default, G, KINK, torch.zeros(7), 0, 1.0),
    case(aten.mse_loss_backward.default, torch.tensor(1.0), KINK, torch.zeros(7), 1),
    case(
        aten.max_pool2d_with_indices.default,
        torch.tensor([[[[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]]]),
        [2, 2],
        [1, 1],
        id="max_pool_ties",
    ),
]


@pytest.mark.parametrize("op, args, kwargs", GRADIENTS)
def test_gradients_at_kinks(op, args, kwargs):
    check_rule(op, *args, signed_zeros=True, **kwargs)


@pytest.mark.parametrize("op", [aten.relu.default, aten.abs.default, aten.clamp.default])
def test_autograd_at_zero_matches_eager(op):
    """The end-to-end gradient a user gets at exactly 0 (and at clamp's bounds) on the device."""
    import torchacc

    x = torch.tensor([-1.0, -0.0, 0.0, 1.0, -2.0, 2.0])
    args = (-1.0, 1.0) if op is aten.clamp.default else ()
    ref = x.clone().requires_grad_()
    op(ref, *args).mul(torch.arange(6.0)).sum().backward()
    dev = x.to(torchacc.device()).requires_grad_()
    op(dev, *args).mul(torch.arange(6.0).to(torchacc.device())).sum().backward()
    got = dev.grad.cpu()
    assert torch.equal(got, ref.grad), (got, ref.grad)


# --- properties (hypothesis): a few fast ones where a formula is easy to get subtly wrong ---

FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
SMALL = settings(max_examples=25, deadline=None, derandomize=True)


@SMALL
@given(st.lists(FLOATS, min_size=1, max_size=6), st.lists(FLOATS, min_size=1, max_size=6))
def test_property_division_family(a, b):
    n = min(len(a), len(b))
    x, y = torch.tensor(a[:n]), torch.tensor(b[:n])
    for op, kw in (
        (aten.remainder.Tensor, {}),
        (aten.fmod.Tensor, {}),
        (aten.div.Tensor_mode, {"rounding_mode": "floor"}),
        (aten.atan2.default, {}),
    ):
        check_rule(op, x, y, rtol=1e-5, atol=1e-5, **kw)


@SMALL
@given(st.lists(st.integers(-4, 4).map(float), min_size=1, max_size=8))
def test_property_sort_argmax_ties(values):
    """Few distinct values: many ties. Stable sort and argmax must pick torch's indices."""
    x = torch.tensor(values).view(1, -1)
    check_rule(aten.sort.stable, x, stable=True, dim=1)
    check_rule(aten.argmax.default, x, 1)
    check_rule(aten.max.dim, x, 1)
    _check_topk(x, min(3, x.shape[1]), largest=True)


@SMALL
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=6),
    st.lists(st.integers(-(2**31), 2**31 - 1).filter(lambda v: v != 0), min_size=1, max_size=6),
)
def test_property_int32_arithmetic(a, b):
    n = min(len(a), len(b))
    x, y = torch.tensor(a[:n], dtype=torch.int32), torch.tensor(b[:n], dtype=torch.int32)
    for op in (aten.add.Tensor, aten.mul.Tensor, aten.remainder.Tensor, aten.floor_divide.default):
        if op is aten.floor_divide.default and bool(((x == -(2**31)) & (y == -1)).any()):
            continue  # INT_MIN // -1 overflows: torch leaves it undefined
        check_rule(op, x, y, rtol=0, atol=0)
