"""Pointwise lowering rules (torchacc/lowering/pointwise.py) against eager PyTorch on CPU."""

import pytest
import torch
from lowering_harness import check_rule

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)

BF16 = dict(rtol=1.6e-2, atol=1e-2)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def pos(*shape, dtype=torch.float32):
    return (torch.rand(*shape, generator=g) * 3 + 0.1).to(dtype)


def unit(*shape, dtype=torch.float32):
    return (torch.rand(*shape, generator=g) * 1.8 - 0.9).to(dtype)


def ints(*shape, low=-5, high=6, dtype=torch.int64, nonzero=False):
    t = torch.randint(low, high, shape, generator=g)
    if nonzero:
        t = torch.where(t == 0, torch.ones_like(t), t)
    return t.to(dtype)


def bools(*shape):
    return torch.rand(*shape, generator=g) > 0.5


def special(*shape):
    t = randn(*shape)
    t[0, 0], t[0, 1], t[1, 0] = float("nan"), float("inf"), float("-inf")
    return t


X, Y = randn(3, 4), randn(3, 4)
XB, YB = randn(3, 4, dtype=torch.bfloat16), randn(3, 4, dtype=torch.bfloat16)
IA, IB = ints(3, 4), ints(3, 4, nonzero=True)


def case(op, *args, tol=None, id=None, **kwargs):
    return pytest.param(op, args, kwargs, tol or {}, id=id or str(op).replace("aten.", ""))


ARITH = [
    case(aten.add.Tensor, X, Y),
    case(aten.add.Tensor, X, randn(4), alpha=2, id="add_bcast_alpha"),
    case(aten.add.Tensor, X, 2, id="add_pyint"),
    case(aten.add.Tensor, IA, 2.5, id="add_int_pyfloat"),
    case(aten.add.Tensor, IA, torch.tensor(2.5, dtype=torch.float64), id="add_int_0d_f64"),
    case(aten.add.Tensor, X, torch.tensor(2.5, dtype=torch.float64), id="add_f32_0d_f64"),
    case(aten.add.Tensor, IA, IB, alpha=3, id="add_int"),
    case(aten.add.Tensor, XB, YB, tol=BF16, id="add_bf16"),
    case(aten.add.Tensor, XB, X, id="add_bf16_f32"),
    case(aten.add.Scalar, X, 2.5, 3),
    case(aten.sub.Tensor, X, Y, alpha=0.5),
    case(aten.sub.Scalar, IA, 3),
    case(aten.rsub.Scalar, X, 1.0),
    case(aten.rsub.Tensor, X, Y, alpha=2),
    case(aten.mul.Tensor, X, Y),
    case(aten.mul.Tensor, XB, 0.1, tol=BF16, id="mul_bf16_scalar"),
    case(aten.mul.Scalar, XB, 0.1, tol=BF16),
    case(aten.mul.Tensor, IA, IB, id="mul_int"),
    case(aten.mul.Tensor, bools(3, 4), bools(3, 4), id="mul_bool"),
    case(aten.div.Tensor, X, Y),
    case(aten.div.Tensor, IA, IB, id="div_int_true"),
    case(aten.div.Scalar, IA, 4),
    case(aten.div.Tensor_mode, X * 5, Y, rounding_mode="floor", id="div_floor"),
    case(aten.div.Tensor_mode, X * 5, Y, rounding_mode="trunc", id="div_trunc"),
    case(aten.div.Tensor_mode, IA, IB, rounding_mode="floor", id="div_floor_int"),
    case(aten.div.Tensor_mode, IA, IB, rounding_mode="trunc", id="div_trunc_int"),
    case(aten.div.Tensor_mode, X, Y, rounding_mode=None, id="div_mode_none"),
    case(aten.div.Scalar_mode, IA, -3, rounding_mode="floor"),
    case(aten.floor_divide.default, X * 5, Y),
    case(aten.floor_divide.default, IA, IB, id="floor_divide_int"),
    case(aten.floor_divide.Scalar, IA, 3),
    case(aten.remainder.Tensor, X * 5, Y),
    case(aten.remainder.Tensor, IA, IB, id="remainder_int"),
    case(aten.remainder.Scalar, X * 5, -1.5),
    case(aten.remainder.Scalar_Tensor, 5, IB),
    case(aten.fmod.Tensor, X * 5, Y),
    case(aten.fmod.Scalar, IA, 3),
    case(aten.pow.Tensor_Scalar, X, 2, id="pow_2"),
    case(aten.pow.Tensor_Scalar, X, 3, id="pow_3_negative_base"),
    case(aten.pow.Tensor_Scalar, X, 3.0, id="pow_3.0"),
    case(aten.pow.Tensor_Scalar, X, -1, id="pow_-1"),
    case(aten.pow.Tensor_Scalar, X, 0, id="pow_0"),
    case(aten.pow.Tensor_Scalar, pos(3, 4), 0.5, id="pow_0.5"),
    case(aten.pow.Tensor_Scalar, pos(3, 4), -0.5, id="pow_-0.5"),
    case(aten.pow.Tensor_Scalar, pos(3, 4), 1.7, id="pow_1.7"),
    case(aten.pow.Tensor_Scalar, IA, 2, id="pow_int"),
    case(aten.pow.Tensor_Scalar, ints(3, 4, low=0), 0.5, id="pow_int_float"),
    case(aten.pow.Tensor_Scalar, XB, 2, tol=BF16, id="pow_bf16"),
    case(aten.pow.Tensor_Tensor, pos(3, 4), X),
    case(aten.pow.Tensor_Tensor, ints(3, 4, low=0), ints(3, 4, low=0, high=4), id="pow_tt_int"),
    case(aten.pow.Scalar, 2.0, X),
    case(aten.pow.Scalar, 3, ints(3, 4, low=0, high=5), id="pow_scalar_int"),
    case(aten.addcmul.default, X, Y, randn(4), value=0.5),
    case(aten.addcdiv.default, X, Y, pos(3, 4), value=-2),
    case(aten.addcmul.default, XB, YB, XB, value=0.5, tol=BF16, id="addcmul_bf16"),
    case(aten.lerp.Scalar, X, Y, 0.3),
    case(aten.lerp.Scalar, X, Y, 0.8, id="lerp_big_weight"),
    case(aten.lerp.Tensor, X, Y, torch.rand(3, 4, generator=g)),
    case(aten.lerp.Scalar, XB, YB, 0.3, tol=BF16, id="lerp_bf16"),
]

BINARY = [
    case(aten.atan2.default, X, Y),
    case(aten.hypot.default, X, Y),
    case(aten.logaddexp.default, X, Y),
    case(aten.xlogy.Tensor, torch.where(X > 0, X, 0.0), pos(3, 4)),
    case(aten.maximum.default, special(3, 4), Y),
    case(aten.minimum.default, special(3, 4), Y),
    case(aten.maximum.default, IA, IB, id="maximum_int"),
    case(aten.max.other, X, Y),
    case(aten.min.other, X, Y),
    case(aten.fmax.default, special(3, 4), Y),
    case(aten.fmin.default, special(3, 4), Y),
    case(aten.bitwise_and.Tensor, IA, IB),
    case(aten.bitwise_or.Tensor, bools(3, 4), bools(3, 4)),
    case(aten.bitwise_xor.Tensor, IA, IB),
    case(aten.bitwise_and.Scalar, IA, 6),
    case(aten.bitwise_or.Scalar_Tensor, 6, IB),
    case(aten.bitwise_not.default, IA),
    case(aten.bitwise_not.default, bools(3, 4), id="bitwise_not_bool"),
    case(aten.__lshift__.Scalar, ints(3, 4, dtype=torch.int32), 2),
    case(aten.__rshift__.Tensor, IA, ints(3, 4, low=0, high=3)),
    case(aten.logical_and.default, X, bools(3, 4)),
    case(aten.logical_or.default, bools(3, 4), bools(3, 4)),
    case(aten.logical_xor.default, IA, X),
    case(aten.logical_not.default, X.round()),
]
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _p = getattr(aten, _name)
    BINARY += [
        case(_p.Tensor, X.round(), Y.round(), id=f"{_name}_tensor"),
        case(_p.Tensor, IA, IB, id=f"{_name}_int"),
        case(_p.Scalar, X.round(), 0, id=f"{_name}_scalar"),
        case(_p.Scalar, IA, 0.5, id=f"{_name}_int_float_scalar"),
        case(_p.Scalar, XB, 0.1, id=f"{_name}_bf16_scalar"),
    ]
BINARY.append(case(aten.eq.Scalar, torch.full((3,), 0.1, dtype=torch.bfloat16), 0.1, id="eq_bf16"))

UNARY = []
_DOMAINS = {
    "log": pos,
    "log2": pos,
    "log10": pos,
    "log1p": pos,
    "sqrt": pos,
    "rsqrt": pos,
    "reciprocal": pos,
    "lgamma": pos,
    "digamma": pos,
    "asin": unit,
    "acos": unit,
    "atanh": unit,
    "erfinv": unit,
    "acosh": lambda *s: pos(*s) + 1,
}
for _name in (
    "exp exp2 log log2 log10 log1p expm1 sqrt rsqrt reciprocal sin cos tan asin acos atan sinh "
    "cosh tanh asinh acosh atanh sigmoid erf erfc erfinv lgamma digamma"
).split():
    _x = _DOMAINS.get(_name, randn)(3, 4)
    _op = getattr(aten, _name).default
    UNARY.append(case(_op, _x, tol=dict(rtol=1e-5, atol=1e-5)))
    UNARY.append(case(_op, _x.bfloat16(), tol=BF16, id=f"{_name}_bf16"))
UNARY += [
    case(aten.exp.default, ints(3, 4), id="exp_int"),
    case(aten.sqrt.default, ints(3, 4, low=0), id="sqrt_int"),
    case(aten.sigmoid.default, bools(3, 4), id="sigmoid_bool"),
]
for _name in ("floor", "ceil", "round", "trunc", "frac", "neg", "abs", "sign", "sgn", "relu"):
    _op = getattr(aten, _name).default
    UNARY.append(case(_op, randn(3, 4, scale=3)))
    UNARY.append(case(_op, XB * 3, tol=BF16, id=f"{_name}_bf16"))
    if _name != "frac":
        UNARY.append(case(_op, IA, id=f"{_name}_int"))
UNARY += [
    case(aten.round.default, torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5]), id="round_half_even"),
    case(aten.sign.default, bools(3, 4), id="sign_bool"),
    case(aten.round.decimals, randn(3, 4, scale=100), decimals=2),
    case(aten.round.decimals, randn(3, 4, scale=100), decimals=-1, id="round_decimals_neg"),
    case(aten.nan_to_num.default, special(3, 4)),
    case(aten.nan_to_num.default, special(3, 4), 1.0, 2.0, -2.0, id="nan_to_num_args"),
    case(aten.nan_to_num.default, special(3, 4).bfloat16(), id="nan_to_num_bf16"),
]
for _name in ("isnan", "isinf", "isposinf", "isneginf", "signbit"):
    UNARY.append(case(getattr(aten, _name).default, special(3, 4)))
    UNARY.append(case(getattr(aten, _name).default, IA, id=f"{_name}_int"))

SELECT = [
    case(aten.where.self, bools(3, 4), X, Y),
    case(aten.where.self, bools(3, 4), X, torch.tensor(0.0), id="where_0d"),
    case(aten.where.self, bools(3, 4), IA, torch.tensor(0.5), id="where_int_0d_float"),
    case(aten.where.self, bools(3, 4), XB, X, id="where_bf16_f32"),
    case(aten.clamp.default, X, -0.5, 0.5),
    case(aten.clamp.default, X, 0, id="clamp_min_only"),
    case(aten.clamp.default, X, None, 0.2, id="clamp_max_only"),
    case(aten.clamp.default, IA, 0.5, id="clamp_int_float"),
    case(aten.clamp.default, XB, -0.3, 0.3, id="clamp_bf16"),
    case(aten.clamp.Tensor, X, Y, None),
    case(aten.clamp.Tensor, X, None, torch.tensor(0.5), id="clamp_tensor_max"),
    case(aten.clamp.Tensor, X, Y - 1, Y + 1, id="clamp_tensor_both"),
    case(aten.clamp_min.default, X, 0.1),
    case(aten.clamp_min.Tensor, X, Y),
    case(aten.clamp_max.default, IA, 2),
    case(aten.clamp_max.Tensor, X, Y),
    case(aten.masked_fill.Scalar, X, bools(3, 4), 1.5),
    case(aten.masked_fill.Scalar, IA, bools(3, 4), -7),
    case(aten.masked_fill.Tensor, XB, bools(4), torch.tensor(0.1), tol=BF16),
    case(aten._to_copy.default, X, dtype=torch.float16, tol=dict(rtol=1e-3)),
    case(aten._to_copy.default, X, dtype=torch.bfloat16, tol=BF16, id="to_bf16"),
    case(aten._to_copy.default, X * 5, dtype=torch.int32, id="to_int"),
    case(aten._to_copy.default, X.round(), dtype=torch.bool, id="to_bool"),
    case(aten._to_copy.default, XB, dtype=torch.float32, id="bf16_to_f32"),
    case(aten._to_copy.default, IA, dtype=torch.float64, layout=torch.strided, id="to_with_layout"),
    case(aten._to_copy.default, X, id="to_nothing"),
    case(aten.copy.default, X, randn(4)),
    case(aten.copy.default, X, IA, id="copy_cast"),
    case(aten.clone.default, X),
    case(aten.clone.default, X, memory_format=torch.contiguous_format, id="clone_mf"),
    case(aten.alias.default, X),
    case(aten.detach.default, X),
    case(aten.lift_fresh_copy.default, X),
]

X4 = randn(3, 4, scale=4)
ACT = [
    case(aten.gelu.default, X4),
    case(aten.gelu.default, X4, approximate="tanh", id="gelu_tanh"),
    case(aten.gelu.default, X4.bfloat16(), tol=BF16, id="gelu_bf16"),
    case(aten.silu.default, X4),
    case(aten.mish.default, X4),
    case(aten.hardsigmoid.default, X4),
    case(aten.hardswish.default, X4),
    case(aten.softplus.default, X4),
    case(aten.softplus.default, X4, 2.0, 3.0, id="softplus_args"),
    case(aten.elu.default, X4),
    case(aten.elu.default, X4, 1.6732632423543772, 1.0507009873554805, id="selu"),
    case(aten.elu.default, X4, 0.5, 2.0, 1.5, id="elu_args"),
    case(aten.celu.default, X4, 0.7),
    case(aten.leaky_relu.default, X4),
    case(aten.leaky_relu.default, X4, 0.2, id="leaky_relu_slope"),
    case(aten.leaky_relu.default, X4.bfloat16(), 0.2, tol=BF16, id="leaky_relu_bf16"),
    case(aten.hardtanh.default, X4),
    case(aten.hardtanh.default, X4, 0.0, 6.0, id="relu6"),
    case(aten.logit.default, torch.rand(3, 4, generator=g)),
    case(aten.logit.default, torch.tensor([0.0, 1e-8, 0.5, 1.0]), 1e-6, id="logit_eps"),
    case(aten.hardshrink.default, X4),
    case(aten.softshrink.default, X4, 0.7),
    case(aten.threshold.default, X4, 0.1, 20.0),
    case(aten.glu.default, randn(3, 4)),
    case(aten.glu.default, randn(4, 3), 0, id="glu_dim0"),
    case(aten.log_sigmoid_forward.default, X4),
    case(aten.relu.default, X4.bfloat16(), id="relu_bf16"),
]

G = randn(3, 4)
SIG, TANH = torch.sigmoid(X4), torch.tanh(X4)
BACKWARD = [
    case(aten.threshold_backward.default, G, X4, 0.0),
    case(aten.threshold_backward.default, G, X4, 0.5, id="threshold_backward_0.5"),
    case(aten.sigmoid_backward.default, G, SIG),
    case(aten.tanh_backward.default, G, TANH),
    case(aten.tanh_backward.default, G.bfloat16(), TANH.bfloat16(), tol=BF16, id="tanh_bw_bf16"),
    case(aten.gelu_backward.default, G, X4),
    case(aten.gelu_backward.default, G, X4, approximate="tanh", id="gelu_backward_tanh"),
    case(aten.silu_backward.default, G, X4),
    case(aten.mish_backward.default, G, X4, tol=dict(rtol=1e-5, atol=1e-5)),
    case(aten.leaky_relu_backward.default, G, X4, 0.2, False),
    case(aten.hardtanh_backward.default, G, X4, -1.0, 1.0),
    case(aten.elu_backward.default, G, 1.0, 1.0, 1.0, False, X4),
    case(
        aten.elu_backward.default,
        G,
        0.5,
        2.0,
        1.5,
        True,
        torch.nn.functional.elu(X4, 0.5),
        id="elu_backward_result",
    ),
    case(aten.softplus_backward.default, G, X4, 1.0, 20.0),
    case(aten.softplus_backward.default, G, X4, 2.0, 3.0, id="softplus_backward_args"),
    case(aten.hardswish_backward.default, G, X4),
    case(aten.hardsigmoid_backward.default, G, X4),
    case(aten.logit_backward.default, G, torch.rand(3, 4, generator=g)),
    case(aten.logit_backward.default, G, torch.rand(3, 4, generator=g), 0.2, id="logit_bw_eps"),
    case(aten.log_sigmoid_backward.default, G, X4, torch.exp(-X4.abs())),
]


@pytest.mark.parametrize("op,args,kwargs,tol", ARITH + BINARY + UNARY + SELECT + ACT + BACKWARD)
def test_pointwise(op, args, kwargs, tol):
    check_rule(op, *args, **kwargs, **tol)
