"""View, join, indexing and scatter lowering rules (torchacc/lowering/shape.py) vs eager PyTorch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from lowering_harness import check_rule

from torchacc.lowering import lookup

aten = torch.ops.aten
g = torch.Generator().manual_seed(2)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def ints(*shape, low=-5, high=6, dtype=torch.int64):
    return torch.randint(low, high, shape, generator=g).to(dtype)


def bools(*shape):
    return torch.rand(*shape, generator=g) > 0.5


def unique_index(rows, n, k):
    """(rows, k) indices into a dim of size n, unique within each row."""
    return torch.argsort(torch.rand(rows, n, generator=g), dim=1)[:, :k]


X = randn(3, 4)
X3 = randn(2, 3, 4)
XB = randn(3, 4, dtype=torch.bfloat16)
IA = ints(3, 4)


def case(op, *args, id=None, **kwargs):
    return pytest.param(op, args, kwargs, id=id or str(op).replace("aten.", ""))


VIEWS = [
    case(aten.view.default, X3, [6, -1]),
    case(aten._unsafe_view.default, X3, [24]),
    case(aten.reshape.default, X3, [4, 6]),
    case(aten.view.dtype, X, torch.int32),
    case(aten.view.dtype, X, torch.bfloat16, id="view_dtype_shrink"),
    case(aten.view.dtype, XB, torch.float32, id="view_dtype_grow"),
    case(aten.view.dtype, bools(3, 4), torch.uint8, id="view_dtype_bool"),
    case(aten.expand.default, randn(3, 1), [2, -1, 4]),
    case(aten.expand_copy.default, randn(1, 4), [3, 4]),
    case(aten.permute.default, X3, [2, 0, 1]),
    case(aten.permute.default, X3, [-1, 1, 0], id="permute_neg"),
    case(aten.transpose.int, X3, 0, -1),
    case(aten.t.default, X),
    case(aten.t.default, randn(4), id="t_1d"),
    case(aten.unsqueeze.default, X, -1),
    case(aten.unsqueeze.default, X, 1, id="unsqueeze_mid"),
    case(aten.squeeze.default, randn(1, 3, 1, 4)),
    case(aten.squeeze.dim, randn(1, 3, 1, 4), 2),
    case(aten.squeeze.dim, X, 0, id="squeeze_dim_not_one"),
    case(aten.squeeze.dims, randn(1, 3, 1, 4), [0, -2, 1]),
    case(aten.slice.Tensor, X3, 2, 1, 3),
    case(aten.slice.Tensor, X3, -1, -3, None, id="slice_negative"),
    case(aten.slice.Tensor, X3, 1, 1, 2**63 - 1, id="slice_overflow"),
    case(aten.slice.Tensor, X3, 2, 0, 4, 3, id="slice_step"),
    case(aten.slice.Tensor, X3, 2, 3, 1, id="slice_empty"),
    case(aten.slice.Tensor, X3, 0, None, None, id="slice_none"),
    case(aten.select.int, X3, 1, -1),
    case(aten.select.int, X3, 0, 1, id="select_pos"),
    case(aten.narrow.default, X3, 2, 1, 2),
    case(aten.narrow.default, X3, -1, -3, 2, id="narrow_neg"),
    case(aten.diagonal.default, X),
    case(aten.diagonal.default, X, 1, id="diagonal_offset"),
    case(aten.diagonal.default, X, -2, id="diagonal_neg_offset"),
    case(aten.diagonal.default, X3, 0, 0, 2, id="diagonal_dims"),
    case(aten.diagonal.default, X3, 1, -1, 1, id="diagonal_dims_neg"),
    case(aten.split.Tensor, randn(7, 3), 3),
    case(aten.split.Tensor, X, 2, 1, id="split_dim1"),
    case(aten.split_with_sizes.default, randn(7, 3), [2, 0, 5]),
    case(aten.unbind.int, X3, 1),
    case(aten.unfold.default, randn(3, 10), 1, 3, 2),
    case(aten.unfold.default, randn(10, 3), 0, 4, 4, id="unfold_dim0"),
    case(aten.unfold.default, randn(2, 50), -1, 20, 7, id="unfold_big_window"),
    case(aten.as_strided.default, randn(24), [4, 6], [6, 1]),
    case(aten.as_strided.default, randn(24), [6, 4], [1, 6], id="as_strided_transposed"),
    case(aten.as_strided.default, randn(24), [2, 3], [8, 2], 3, id="as_strided_slice"),
    case(aten.as_strided.default, randn(10), [4, 3], [2, 1], id="as_strided_overlap"),
    case(aten.as_strided.default, randn(12), [3, 4], [0, 1], 2, id="as_strided_broadcast"),
    case(aten.as_strided.default, randn(24), [2, 1, 3], [12, 5, 1], 4, id="as_strided_size1"),
    case(aten.as_strided.default, randn(7), [2, 2], [5, 1], id="as_strided_past_end"),
    case(aten.as_strided.default, randn(12), [2, 2, 2], [1, 4, 2], 1, id="as_strided_perm"),
    case(aten.as_strided_scatter.default, randn(24), randn(4, 6), [4, 6], [6, 1]),
    case(aten.as_strided_scatter.default, randn(24), randn(2, 3), [2, 3], [1, 4], 2, id="ass_gen"),
    case(aten.as_strided_scatter.default, randn(4, 6), randn(2, 5), [2, 5], [6, 1], 1, id="ass_2d"),
]

SCATTERS = [
    case(aten.slice_scatter.default, X3, randn(2, 3, 2), 2, 1, 3),
    case(aten.slice_scatter.default, X3, randn(2, 3, 2), -1, None, None, 2, id="slice_sc_step"),
    case(aten.slice_scatter.default, X3, randn(2, 2, 4), 1, -2, id="slice_scatter_neg"),
    case(aten.slice_scatter.default, IA, randn(3, 2), 1, 0, 2, id="slice_scatter_cast"),
    case(aten.select_scatter.default, X3, randn(2, 4), 1, -1),
    case(aten.diagonal_scatter.default, X, randn(3)),
    case(aten.diagonal_scatter.default, X, randn(3), 1, id="diag_scatter_offset"),
    case(aten.diagonal_scatter.default, X3, randn(3, 2), -1, 2, 0, id="diag_scatter_dims"),
    case(aten.slice_backward.default, randn(2, 3, 2), [2, 3, 4], 2, 1, 3, 1),
    case(aten.slice_backward.default, randn(2, 2, 4), [2, 4, 4], 1, 0, 4, 2, id="slice_bw_step"),
    case(aten.select_backward.default, randn(2, 4), [2, 3, 4], 1, 2),
    case(aten.diagonal_backward.default, randn(2, 3), [2, 3, 4], 1, 1, 2),
    case(aten.unfold_backward.default, randn(3, 4, 3), [3, 10], 1, 3, 2),
    case(aten.unfold_backward.default, randn(3, 3, 3), [10, 3], 0, 3, 3, id="unfold_bw_dim0"),
    case(aten.unfold_backward.default, randn(2, 5, 20), [2, 50], 1, 20, 7, id="unfold_bw_big"),
]

JOINS = [
    case(aten.cat.default, [X, randn(2, 4)]),
    case(aten.cat.default, [X, randn(3, 2)], -1, id="cat_neg_dim"),
    case(aten.cat.default, [X, torch.empty(0), randn(1, 4)], id="cat_legacy_empty"),
    case(aten.cat.default, [X, IA], id="cat_promote"),
    case(aten.cat.default, [XB, X], id="cat_bf16_f32"),
    case(aten.stack.default, [X, X, X]),
    case(aten.stack.default, [X, IA], -1, id="stack_neg_promote"),
    case(aten.flip.default, X3, [0, -1]),
    case(aten.roll.default, X3, [1, -2], [0, 2]),
    case(aten.roll.default, X3, [5], id="roll_flat"),
    case(aten.repeat.default, X, [2, 1, 3]),
    case(aten.constant_pad_nd.default, X3, [1, 2]),
    case(aten.constant_pad_nd.default, X3, [1, -1, -1, 2, 0, 1], 1.5, id="pad_negative"),
    case(aten.constant_pad_nd.default, IA, [2, 2], 7, id="pad_int"),
    case(aten.tril.default, X3),
    case(aten.tril.default, X, -1, id="tril_diag"),
    case(aten.triu.default, X3, 1),
]

I2 = torch.tensor([2, 0, -1])
INDEXING = [
    case(aten.index.Tensor, X3, [torch.tensor([1, 0, 1])]),
    case(aten.index.Tensor, X3, [None, I2], id="index_second_dim"),
    case(aten.index.Tensor, X3, [None, None, torch.tensor([[3, 0], [-1, 2]])], id="index_2d"),
    case(aten.index.Tensor, X3, [torch.tensor([[1], [0]]), I2], id="index_broadcast"),
    case(
        aten.index.Tensor, X3, [torch.tensor([1, 0]), None, torch.tensor([3, 1])], id="index_nonadj"
    ),
    case(aten.index.Tensor, X3, [None, I2.int(), torch.tensor([0, 1, 3])], id="index_int32_adj"),
    case(aten._unsafe_index.Tensor, X3, [None, I2]),
    case(aten.index_put.default, X3, [torch.tensor([1, 0])], randn(2, 3, 4)),
    case(aten.index_put.default, X3, [None, I2], torch.tensor(5.0), id="index_put_scalar"),
    case(aten.index_put.default, X3, [torch.tensor([1, 1, 0])], randn(3, 4), True, id="ip_acc"),
    case(
        aten.index_put.default,
        X3,
        [torch.tensor([1, 0]), None, torch.tensor([0, 3])],
        randn(2, 3),
        id="index_put_nonadj",
    ),  # fmt: skip
    case(aten.index_put.default, IA, [torch.tensor([0, 2])], ints(2, 4), id="index_put_int"),
    case(aten._unsafe_index_put.default, X3, [None, None, I2], randn(3), True),
    case(aten.index_put.default, X3, [X3 > 0], torch.tensor(0.0), id="index_put_mask_scalar"),
    case(aten.index_put.default, X, [X > 0], randn(int((X > 0).sum())), id="index_put_mask_values"),
    case(aten.index_put.default, X3, [None, X3[0] > 0], torch.tensor(2.0), True, id="ip_mask_acc"),
    case(aten.index_put.default, X3, [torch.tensor([True, False])], randn(4), id="ip_mask_row"),
    case(aten.index_put.default, X3, [torch.tensor([True, True])], randn(2, 3, 4), id="ip_mask_n"),
    case(aten.take.default, X, torch.tensor([[0, 11], [-1, 5]])),
    case(aten.index_select.default, X3, 1, I2.abs()),
    case(aten.index_select.default, X3, -1, torch.tensor(2), id="index_select_0d"),
    case(aten.gather.default, X3, 2, ints(2, 3, 2, low=0, high=4)),
    case(aten.gather.default, X3, 1, ints(1, 2, 3, low=0, high=3), id="gather_smaller"),
    case(aten.gather.default, X, -2, ints(3, 4, low=0, high=3), id="gather_neg_dim"),
    case(aten.masked_scatter.default, X, X > 0, randn(12)),
    case(aten.masked_scatter.default, X3, bools(4), randn(30), id="masked_scatter_bcast"),
]

DUP = ints(3, 6, low=0, high=4)  # duplicates along dim 1
SELF = randn(3, 4)
SCATTER_OPS = [
    case(aten.scatter.src, SELF, 1, unique_index(3, 4, 3), randn(3, 5)),
    case(aten.scatter.value, SELF, 1, unique_index(3, 4, 2), 2.5),
    case(aten.scatter.value, IA, 0, torch.tensor([[2, 0, 1, 1]]), -3, id="scatter_value_int"),
    case(aten.scatter.reduce, SELF, 1, DUP, randn(3, 6), reduce="add"),
    case(aten.scatter.reduce, SELF, 1, DUP, randn(3, 6), reduce="multiply", id="scatter_mul"),
    case(aten.scatter.value_reduce, SELF, 1, DUP, 2.0, reduce="multiply"),
    case(aten.scatter_add.default, SELF, 1, DUP, randn(3, 6)),
    case(aten.scatter_add.default, SELF, 0, ints(5, 4, low=0, high=3), randn(5, 4), id="sa_dim0"),
    case(aten.index_add.default, SELF, 0, torch.tensor([2, 0, 2]), randn(3, 4)),
    case(
        aten.index_add.default, SELF, 1, torch.tensor([3, 3]), randn(3, 2), alpha=0.5, id="ia_alpha"
    ),
    case(aten.index_copy.default, SELF, 1, torch.tensor([3, 0]), randn(3, 2)),
    case(aten.index_fill.int_Scalar, SELF, 1, torch.tensor([3, 0]), -1.5),
    case(aten.index_fill.int_Tensor, IA, 0, torch.tensor([1]), torch.tensor(9)),
]
for _reduce in ("sum", "prod", "mean", "amax", "amin"):
    for _incl in (True, False):
        SCATTER_OPS.append(
            case(
                aten.scatter_reduce.two,
                SELF,
                1,
                DUP,
                randn(3, 6),
                _reduce,
                include_self=_incl,
                id=f"scatter_reduce_{_reduce}_{_incl}",
            )  # fmt: skip
        )
    SCATTER_OPS.append(
        case(
            aten.scatter_reduce.two,
            IA,
            1,
            DUP,
            ints(3, 6),
            _reduce,
            include_self=False,
            id=f"scatter_reduce_{_reduce}_int",
        )  # fmt: skip
    )


@pytest.mark.parametrize("op,args,kwargs", VIEWS + SCATTERS + JOINS + INDEXING + SCATTER_OPS)
def test_shape(op, args, kwargs):
    check_rule(op, *args, **kwargs, rtol=1e-6, atol=1e-6)


def test_index_with_mask_is_left_to_fallback():
    rule = lookup(aten.index.Tensor)
    with pytest.raises(NotImplementedError):
        rule.fn(jnp.zeros((2, 3)), [jnp.array([True, False])])


def test_narrow_tensor_start():
    # the harness cannot compute narrow.Tensor's meta (it reads ``start``); compare directly
    rule = lookup(aten.narrow.Tensor)
    for start in (1, -3):
        got = jax.jit(lambda x, s: rule.fn(x, 2, s, 2))(jnp.asarray(X3.numpy()), jnp.asarray(start))
        np.testing.assert_array_equal(np.asarray(got), X3.narrow(2, start, 2).numpy())
