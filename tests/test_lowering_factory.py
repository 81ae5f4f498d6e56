"""Factory and random lowering rules (torchacc/lowering/factory.py).

Deterministic factories are compared with eager PyTorch; ``empty*`` and random ops cannot be, so
their shape/dtype, range and moments are checked, and different keys must give different samples.
"""

import numpy as np
import pytest
import torch
from lowering_harness import check_rule, run_rule

aten = torch.ops.aten
X = torch.randn(3, 4)
IA = torch.randint(-5, 5, (3, 4))


def case(op, *args, id=None, **kwargs):
    return pytest.param(op, args, kwargs, id=id or str(op).replace("aten.", ""))


FACTORIES = [
    case(aten.zeros.default, [2, 3]),
    case(aten.zeros.default, [2, 3], dtype=torch.int32, id="zeros_int"),
    case(aten.zeros_like.default, X),
    case(aten.zeros_like.default, X, dtype=torch.bfloat16, id="zeros_like_bf16"),
    case(aten.new_zeros.default, X, [2]),
    case(aten.zero.default, IA),
    case(aten.ones.default, [4], dtype=torch.bool),
    case(aten.ones_like.default, IA),
    case(aten.new_ones.default, X, [3], dtype=torch.int32),
    case(aten.full.default, [2, 3], 2.5),
    case(aten.full.default, [2, 3], 7, dtype=torch.float32, id="full_int_value"),
    case(aten.full.default, [2], True, id="full_bool"),
    case(aten.full.default, [2], 3, id="full_int"),
    case(aten.full_like.default, X, 7),
    case(aten.full_like.default, X, 0.1, dtype=torch.bfloat16, id="full_like_bf16"),
    case(aten.new_full.default, X, [2], 3.0),
    case(aten.fill.Scalar, X, 1.5),
    case(aten.fill.Scalar, IA, 4, id="fill_int"),
    case(aten.fill.Tensor, X, torch.tensor(2.0)),
    case(aten.scalar_tensor.default, 3.5),
    case(aten.scalar_tensor.default, 2, dtype=torch.int64, id="scalar_tensor_int"),
    case(aten.arange.default, 5),
    case(aten.arange.default, 5.0, id="arange_float_end"),
    case(aten.arange.start, 1, 5),
    case(aten.arange.start_step, 0, 1, 0.1),
    case(aten.arange.start_step, 10, 0, -3, id="arange_negative_step"),
    case(aten.arange.start_step, -1.5, 2.5, 0.5, dtype=torch.bfloat16, id="arange_bf16"),
    case(aten.arange.start, 0, 6, dtype=torch.float32, id="arange_int_to_float"),
    case(aten.linspace.default, 0, 1, 7),
    case(aten.linspace.default, -3, 10, 7, dtype=torch.int64, id="linspace_int"),
    case(aten.linspace.default, 2.0, 5.0, 1, id="linspace_one"),
    case(aten.linspace.default, -1.0, 3.0, 10, dtype=torch.bfloat16, id="linspace_bf16"),
    case(aten.linspace.Tensor_Tensor, torch.tensor(0.0), torch.tensor(2.0), 5),
    case(aten.logspace.default, 0, 2, 5, 2.0),
    case(aten.logspace.default, -1.0, 1.0, 4, id="logspace_base10"),
    case(aten.eye.default, 3),
    case(aten.eye.m, 2, 4, dtype=torch.int64),
]


@pytest.mark.parametrize("op,args,kwargs", FACTORIES)
def test_factory(op, args, kwargs):
    check_rule(op, *args, **kwargs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "op,args,kwargs",
    [
        case(aten.empty.memory_format, [2, 3], dtype=torch.bfloat16),
        case(aten.empty_strided.default, [2, 3], [1, 2]),
        case(aten.empty_like.default, IA),
        case(aten.new_empty.default, X, [5], dtype=torch.int32),
        case(aten.new_empty_strided.default, X, [4, 3], [3, 1]),
        case(aten._efficientzerotensor.default, [2, 3]),  # torch's ZeroTensor has no numpy
    ],
)
def test_empty(op, args, kwargs):
    (got,) = run_rule(op, *args, **kwargs)  # shape and dtype are checked inside
    assert not got.any()


N = 20000
BIG = torch.empty(N)


def sample(op, *args, seed=0, **kwargs):
    (a,) = run_rule(op, *args, rng_seed=seed, **kwargs)
    (b,) = run_rule(op, *args, rng_seed=seed + 1, **kwargs)
    assert a.shape == b.shape
    assert not np.array_equal(a, b), f"{op}: different keys gave the same sample"
    return a


def test_rand_randn():
    u = sample(aten.rand.default, [N])
    assert u.dtype == np.float32 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.02 and abs(u.std() - (1 / 12) ** 0.5) < 0.02
    ub = sample(aten.rand.default, [N], dtype=torch.bfloat16)
    assert 0 <= ub.min() and ub.max() < 1
    z = sample(aten.randn.default, [N])
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05
    assert sample(aten.rand_like.default, X).shape == (3, 4)
    zl = sample(aten.randn_like.default, X, dtype=torch.float64)
    assert zl.dtype == np.float64 and zl.shape == (3, 4)


def test_randint_randperm():
    r = sample(aten.randint.default, 10, [N])
    assert r.dtype == np.int64 and r.min() == 0 and r.max() == 9
    r = sample(aten.randint.low, -3, 3, [N], dtype=torch.int32)
    assert r.dtype == np.int32 and r.min() == -3 and r.max() == 2
    r = sample(aten.randint_like.default, BIG, 5)
    assert r.dtype == np.float32 and set(np.unique(r)) == {0, 1, 2, 3, 4}
    r = sample(aten.randint_like.low_dtype, torch.empty(N, dtype=torch.int64), 2, 4)
    assert set(np.unique(r)) == {2, 3}
    p = sample(aten.randperm.default, 50)
    assert p.dtype == np.int64 and sorted(p) == list(range(50))
    # the ``generator`` overloads (twins of the out= variants torch's factories call) share rules
    p = sample(aten.randperm.generator, 50, generator=None, dtype=torch.int32)
    assert p.dtype == np.int32 and sorted(p) == list(range(50))
    r = sample(aten.randint.low_generator, 1, 4, [N], generator=None)
    assert set(np.unique(r)) == {1, 2, 3}
    u = sample(aten.rand.generator, [N], generator=None)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02


def test_bernoulli():
    p = torch.full((N,), 0.3)
    b = sample(aten.bernoulli.default, p)
    assert set(np.unique(b)) == {0.0, 1.0} and abs(b.mean() - 0.3) < 0.02
    b = sample(aten.bernoulli.p, BIG, 0.8)
    assert abs(b.mean() - 0.8) < 0.02
    b = sample(aten.bernoulli.p, torch.empty(N, dtype=torch.bfloat16), 0.5)
    assert abs(b.mean() - 0.5) < 0.02
    probs = torch.tensor([0.0, 1.0]).repeat(N // 2)
    (b,) = run_rule(aten.bernoulli.Tensor, torch.empty(N), probs)
    np.testing.assert_array_equal(b, probs.numpy())


def test_uniform_normal():
    u = sample(aten.uniform.default, BIG, -2.0, 3.0)
    assert -2 <= u.min() and u.max() < 3 and abs(u.mean() - 0.5) < 0.05
    z = sample(aten.normal_functional.default, BIG, 2.0, 0.5)
    assert abs(z.mean() - 2) < 0.02 and abs(z.std() - 0.5) < 0.02
    z = sample(aten.normal.Tensor_float, torch.full((N,), -1.0), 2.0)
    assert abs(z.mean() + 1) < 0.05 and abs(z.std() - 2) < 0.05
    z = sample(aten.normal.float_Tensor, 3.0, torch.full((N,), 0.1))
    assert abs(z.mean() - 3) < 0.01 and abs(z.std() - 0.1) < 0.01
    std = torch.tensor([0.0, 1.0]).repeat(N // 2)
    z = sample(aten.normal.Tensor_Tensor, torch.zeros(N), std)
    assert (z[::2] == 0).all() and abs(z[1::2].std() - 1) < 0.05
    z = sample(aten.normal.float_float, 1.0, 3.0, [N], dtype=torch.float64)
    assert z.dtype == np.float64 and abs(z.mean() - 1) < 0.1 and abs(z.std() - 3) < 0.1


def test_other_distributions():
    e = sample(aten.exponential.default, BIG, 2.0)
    assert e.min() >= 0 and abs(e.mean() - 0.5) < 0.02
    geo = sample(aten.geometric.default, BIG, 0.25)
    assert geo.min() >= 1 and (geo == np.round(geo)).all() and abs(geo.mean() - 4) < 0.15
    c = sample(aten.cauchy.default, BIG, 1.0, 2.0)
    assert abs(np.median(c) - 1) < 0.1 and abs(np.median(np.abs(c - 1)) - 2) < 0.15
    ln = sample(aten.log_normal.default, BIG, 0.5, 0.25)
    assert ln.min() > 0 and abs(np.log(ln).mean() - 0.5) < 0.01


def test_random():
    r = sample(getattr(aten.random, "from"), torch.empty(N, dtype=torch.int64), 2, 7)
    assert set(np.unique(r)) == {2, 3, 4, 5, 6}
    r = sample(aten.random.to, torch.empty(N, dtype=torch.int8), 5)
    assert r.dtype == np.int8 and set(np.unique(r)) == {0, 1, 2, 3, 4}
    r = sample(aten.random.default, BIG)
    assert r.min() >= 0 and r.max() <= 2**24 and (r == np.round(r)).all() and r.max() > 2**23
    r = sample(aten.random.default, torch.empty(N, dtype=torch.int16))
    assert r.min() >= 0 and r.max() > 2**14
    r = sample(aten.random.default, torch.empty(N, dtype=torch.int64))
    assert r.min() >= 0 and r.max() > 2**61
    r = sample(aten.random.default, torch.empty(N, dtype=torch.bool))
    assert set(np.unique(r)) == {False, True}
