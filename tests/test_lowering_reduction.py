"""Reduction, scan and sort lowering rules (torchacc/lowering/reduction.py) vs eager PyTorch."""

import pytest
import torch
from lowering_harness import check_rule

aten = torch.ops.aten
g = torch.Generator().manual_seed(1)

BF16 = dict(rtol=1.6e-2, atol=1e-2)
LOOSE = dict(rtol=1e-5, atol=1e-5)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def ints(*shape, low=-5, high=6, dtype=torch.int64):
    return torch.randint(low, high, shape, generator=g).to(dtype)


def bools(*shape):
    return torch.rand(*shape, generator=g) > 0.5


def with_nan(*shape):
    t = randn(*shape)
    t.view(-1)[1] = float("nan")
    return t


X = randn(3, 4, 5)
XB = randn(3, 4, 5, dtype=torch.bfloat16)
IA = ints(3, 4, 5)


def case(op, *args, tol=None, id=None, **kwargs):
    return pytest.param(op, args, kwargs, tol or {}, id=id or str(op).replace("aten.", ""))


CASES = [
    case(aten.sum.default, X, tol=LOOSE),
    case(aten.sum.default, IA, id="sum_int"),
    case(aten.sum.default, bools(3, 4), id="sum_bool"),
    case(aten.sum.default, IA, dtype=torch.float32, id="sum_dtype"),
    case(aten.sum.default, XB, tol=BF16, id="sum_bf16"),
    case(aten.sum.dim_IntList, X, [1], tol=LOOSE),
    case(aten.sum.dim_IntList, X, [0, -1], True, tol=LOOSE, id="sum_dims_keepdim"),
    case(aten.sum.dim_IntList, X, None, tol=LOOSE, id="sum_dim_none"),
    case(aten.sum.dim_IntList, X, [], tol=LOOSE, id="sum_dim_empty"),
    case(aten.sum.dim_IntList, XB, [2], dtype=torch.float32, tol=LOOSE, id="sum_bf16_to_f32"),
    case(aten.sum.dim_IntList, ints(3, 4, dtype=torch.uint8, low=0), [0], id="sum_uint8"),
    case(aten.mean.default, X, tol=LOOSE),
    case(aten.mean.default, XB, tol=BF16, id="mean_bf16"),
    case(aten.mean.dim, X, [1, 2], True, tol=LOOSE),
    case(aten.mean.dim, IA, [0], dtype=torch.float32, tol=LOOSE, id="mean_int_dtype"),
    case(aten.prod.default, randn(2, 3)),
    case(aten.prod.default, ints(2, 3, low=1, high=4), id="prod_int"),
    case(aten.prod.dim_int, X, 1, True, tol=LOOSE),
    case(aten.amax.default, X, [1]),
    case(aten.amax.default, X, [], id="amax_all"),
    case(aten.amin.default, X, [0, 2], True),
    case(aten.amax.default, with_nan(3, 4), [1], id="amax_nan"),
    case(aten.max.default, X),
    case(aten.min.default, IA),
    case(aten.max.dim, X, 1),
    case(aten.max.dim, X, -1, True, id="max_dim_keepdim"),
    case(aten.max.dim, torch.tensor([1.0, 3.0, 3.0, 0.0]), 0, id="max_dim_ties"),
    case(aten.max.dim, with_nan(3, 4), 1, id="max_dim_nan"),
    case(aten.min.dim, IA, 2),
    case(aten.min.dim, torch.tensor(5.0), 0, id="min_dim_0d"),
    case(aten.aminmax.default, X),
    case(aten.aminmax.default, X, dim=1, keepdim=True, id="aminmax_dim"),
    case(aten.argmax.default, X),
    case(aten.argmax.default, X, None, True, id="argmax_keepdim_all"),
    case(aten.argmax.default, X, 1, id="argmax_dim"),
    case(aten.argmin.default, IA, -1, True),
    case(aten.argmax.default, with_nan(3, 4), 1, id="argmax_nan"),
    case(aten.var.correction, X, tol=LOOSE),
    case(aten.var.correction, X, [1], correction=0, keepdim=True, tol=LOOSE, id="var_c0"),
    case(aten.var.correction, X, [0, 2], correction=2, tol=LOOSE, id="var_c2"),
    case(aten.var.correction, XB, [1], tol=BF16, id="var_bf16"),
    case(aten.std.correction, X, [2], correction=1, tol=LOOSE),
    case(aten.std.correction, randn(1), id="std_single"),
    case(aten.var_mean.correction, X, [1], correction=1, tol=LOOSE),
    case(aten.std_mean.correction, X, None, keepdim=True, tol=LOOSE),
    case(aten.linalg_vector_norm.default, X, tol=LOOSE),
    case(aten.linalg_vector_norm.default, X, 1, [1], tol=LOOSE, id="norm_1"),
    case(aten.linalg_vector_norm.default, X, 3, [1, 2], True, tol=LOOSE, id="norm_3"),
    case(aten.linalg_vector_norm.default, X, float("inf"), [2], id="norm_inf"),
    case(aten.linalg_vector_norm.default, X, float("-inf"), id="norm_-inf"),
    case(aten.linalg_vector_norm.default, X.round(), 0, [1], id="norm_0"),
    case(aten.linalg_vector_norm.default, XB, 2, [2], tol=BF16, id="norm_bf16"),
    case(aten.linalg_vector_norm.default, XB, dtype=torch.float32, tol=LOOSE, id="norm_dtype"),
    case(aten.norm.Scalar, X, 2, tol=LOOSE),
    case(aten.norm.ScalarOpt_dim, X, 1, [1], True, tol=LOOSE),
    case(aten.any.default, bools(3, 4)),
    case(aten.any.default, IA, id="any_int"),
    case(aten.any.dim, X.round(), 1, True),
    case(aten.any.dims, bools(3, 4, 5), [0, 2]),
    case(aten.any.dims, bools(3, 4), [], id="any_dims_empty"),
    case(aten.any.dims, bools(3, 4), None, id="any_dims_none"),
    case(aten.all.default, bools(3, 4)),
    case(aten.all.dim, X.round(), -1),
    case(aten.all.dims, ints(3, 4, dtype=torch.uint8, low=0, high=2), [1], id="all_uint8"),
    case(aten.count_nonzero.default, X.round()),
    case(aten.count_nonzero.default, IA, 1, id="count_nonzero_dim"),
    case(aten.count_nonzero.dim_IntList, IA, [0, 2]),
    case(aten.logsumexp.default, X, [1], tol=LOOSE),
    case(aten.logsumexp.default, X, [0, 2], True, tol=LOOSE, id="logsumexp_keepdim"),
    case(aten.logsumexp.default, torch.full((2, 3), float("-inf")), [1], id="logsumexp_-inf"),
    case(aten.logsumexp.default, IA, [1], tol=LOOSE, id="logsumexp_int"),
    case(aten.logsumexp.default, XB, [2], tol=BF16, id="logsumexp_bf16"),
    case(aten.cumsum.default, X, 1, tol=LOOSE),
    case(aten.cumsum.default, IA, 0, id="cumsum_int"),
    case(aten.cumsum.default, bools(5), 0, id="cumsum_bool"),
    case(aten.cumsum.default, XB, -1, tol=BF16, id="cumsum_bf16"),
    case(aten.cumsum.default, IA, 2, dtype=torch.float32, id="cumsum_dtype"),
    case(aten.cumprod.default, randn(3, 4), 1, tol=LOOSE),
    case(aten.cummax.default, torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0]), 0, id="cummax_ties"),
    case(
        aten.cummax.default,
        torch.tensor([1.0, float("nan"), 3.0, float("nan")]),
        0,
        id="cummax_nan",
    ),
    case(aten.cummin.default, X, 1),
    case(aten.cummin.default, IA, 2, id="cummin_int"),
    case(aten.sort.default, X),
    case(aten.sort.default, X, 1, True, id="sort_desc"),
    case(aten.sort.default, IA, 2, id="sort_int_ties"),
    case(aten.sort.default, IA, 2, True, id="sort_int_desc_ties"),
    case(aten.sort.stable, with_nan(3, 4), stable=True, dim=1, id="sort_nan"),
    case(aten.sort.stable, with_nan(3, 4), stable=True, dim=1, descending=True, id="sort_nan_desc"),
    case(aten.sort.default, bools(3, 6), 1, True, id="sort_bool_desc"),
    case(aten.sort.default, torch.tensor(5.0), id="sort_0d"),
    case(aten.topk.default, X, 2),
    case(aten.topk.default, X, 3, 1, False, id="topk_smallest"),
    case(aten.topk.default, randn(6, 3), 2, 0, id="topk_dim0"),
    case(
        aten.topk.default,
        torch.tensor([1.0, float("nan"), 3.0, float("nan"), 2.0]),
        3,
        id="topk_nan",
    ),
    case(
        aten.topk.default,
        torch.tensor([1.0, float("nan"), 3.0, 2.0]),
        2,
        largest=False,
        id="topk_small_nan",
    ),
    case(aten.topk.default, torch.randperm(10, generator=g), 4, id="topk_int"),
    case(
        aten.topk.default, torch.randperm(10, generator=g), 4, largest=False, id="topk_int_smallest"
    ),
]


@pytest.mark.parametrize("op,args,kwargs,tol", CASES)
def test_reduction(op, args, kwargs, tol):
    check_rule(op, *args, **kwargs, **tol)
