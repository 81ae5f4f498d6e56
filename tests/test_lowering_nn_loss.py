"""NN lowering rules against eager PyTorch on CPU: losses, embedding, dropout, upsampling."""

import numpy as np
import pytest
import torch
from lowering_harness import check_rule
from test_lowering_nn import BF16, check_opt, randn, run_opt

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -------------------------------------------------------------------------------------------------
# nll_loss (+2d)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("case", ["plain", "weight_ignore", "1d"])
def test_nll_loss(case, reduction):
    if case == "1d":
        x, t, w, ignore = torch.log_softmax(randn(5), 0), torch.tensor(3), None, -100
    else:
        x, t = torch.log_softmax(randn(6, 5), 1), torch.randint(0, 5, (6,))
        w, ignore = (torch.rand(5) + 0.5, 2) if case == "weight_ignore" else (None, -100)
        t[0] = 2
    check_rule(aten.nll_loss_forward.default, x, t, w, reduction, ignore)
    _, total = aten.nll_loss_forward.default(x, t, w, reduction, ignore)
    g = randn(*t.shape) if reduction == 0 else randn(())
    check_rule(aten.nll_loss_backward.default, g, x, t, w, reduction, ignore, total)


@pytest.mark.parametrize("reduction", [0, 1])
def test_nll_loss2d(reduction):
    x, t = torch.log_softmax(randn(2, 4, 3, 5), 1), torch.randint(0, 4, (2, 3, 5))
    t[0, 0, 0] = -100
    w = torch.rand(4) + 0.5
    check_rule(aten.nll_loss2d_forward.default, x, t, w, reduction, -100)
    _, total = aten.nll_loss2d_forward.default(x, t, w, reduction, -100)
    g = randn(*t.shape) if reduction == 0 else randn(())
    check_rule(aten.nll_loss2d_backward.default, g, x, t, w, reduction, -100, total)


def test_nll_loss_bf16():
    x, t = torch.log_softmax(randn(6, 5), 1).bfloat16(), torch.randint(0, 5, (6,))
    check_rule(aten.nll_loss_forward.default, x, t, None, 1, -100, **BF16)


# -------------------------------------------------------------------------------------------------
# pointwise losses


def _loss_inputs(name, shape=(4, 5)):
    if name.startswith("bce"):
        x = torch.rand(*shape) * 0.98 + 0.01 if name == "bce" else randn(*shape, scale=3)
        return x, torch.rand(*shape)
    x = randn(*shape, scale=2)
    t = x + randn(*shape, scale=1.5)
    t[0, :3] = x[0, :3]  # zero differences hit the branch boundaries
    return x, t


LOSSES = {
    "mse": (aten.mse_loss.default, aten.mse_loss_backward.default, {}),
    "bce": (aten.binary_cross_entropy.default, aten.binary_cross_entropy_backward.default, {}),
    "smooth_l1": (aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default, {"beta": 0.7}),
    "smooth_l1_b0": (
        aten.smooth_l1_loss.default,
        aten.smooth_l1_loss_backward.default,
        {"beta": 0},
    ),
    "huber": (aten.huber_loss.default, aten.huber_loss_backward.default, {"delta": 1.3}),
}


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("name", list(LOSSES))
def test_pointwise_loss(name, reduction):
    fwd, bwd, extra = LOSSES[name]
    x, t = _loss_inputs(name)
    extra = list(extra.values())
    if name == "bce":
        w = torch.rand(5) + 0.5
        check_rule(fwd, x, t, w, reduction, rtol=1e-5, atol=1e-6)
        g = randn(*x.shape) if reduction == 0 else randn(())
        check_rule(bwd, g, x, t, w, reduction, rtol=1e-5, atol=1e-6)
        return
    check_rule(fwd, x, t, reduction, *extra, rtol=1e-5, atol=1e-6)
    g = randn(*x.shape) if reduction == 0 else randn(())
    check_rule(bwd, g, x, t, reduction, *extra, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_bce_with_logits(reduction):
    x, t = _loss_inputs("bce_logits")
    op = aten.binary_cross_entropy_with_logits.default
    check_rule(op, x, t, None, None, reduction)
    check_rule(op, x, t, torch.rand(4, 1) + 0.5, torch.rand(5) * 3, reduction, rtol=1e-5, atol=1e-6)


def test_losses_bf16():
    x, t = _loss_inputs("mse")
    check_rule(aten.mse_loss.default, x.bfloat16(), t.bfloat16(), 1, **BF16)
    check_rule(aten.smooth_l1_loss.default, x.bfloat16(), t.bfloat16(), 0, 1.0, **BF16)


# -------------------------------------------------------------------------------------------------
# embedding


@pytest.mark.parametrize("padding_idx,freq", [(-1, False), (0, False), (3, True)])
def test_embedding(padding_idx, freq):
    w = randn(10, 4)
    idx = torch.randint(0, 10, (3, 5))
    idx[0, :3] = torch.tensor([0, 3, 3])
    check_rule(aten.embedding.default, w, idx, padding_idx)
    g = randn(3, 5, 4)
    check_rule(aten.embedding_dense_backward.default, g, idx, 10, padding_idx, freq)


def test_embedding_bf16():
    w, idx = randn(10, 4, dtype=torch.bfloat16), torch.randint(0, 10, (7,))
    check_rule(aten.embedding.default, w, idx)
    g = randn(7, 4, dtype=torch.bfloat16)
    check_rule(aten.embedding_dense_backward.default, g, idx, 10, -1, False, **BF16)


# -------------------------------------------------------------------------------------------------
# dropout (random: moments and masks, not values)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_native_dropout(p):
    x = torch.rand(200, 100) + 1
    (out, mask), metas = run_opt(aten.native_dropout.default, x, p, True, rng_seed=3)
    assert mask.dtype == np.bool_ and metas[1].dtype == torch.bool
    keep = mask.mean()
    assert abs(keep - (1 - p)) < 0.01
    expected = np.where(mask, x.numpy() / (1 - p) if p < 1 else 0.0, 0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    if 0 < p < 1:  # a different key gives a different mask
        (_, mask2), _ = run_opt(aten.native_dropout.default, x, p, True, rng_seed=4)
        assert (mask2 != mask).any()


def test_native_dropout_eval_and_backward():
    x = randn(4, 6, dtype=torch.bfloat16)
    (out, mask), _ = run_opt(aten.native_dropout.default, x, 0.5, False)
    np.testing.assert_array_equal(out, x.float().numpy())
    assert mask.all()
    m = torch.rand(4, 6) > 0.4
    check_rule(aten.native_dropout_backward.default, randn(4, 6), m, 1 / 0.6)
    check_rule(aten.native_dropout_backward.default, x, m, 2.0, **BF16)


# -------------------------------------------------------------------------------------------------
# upsampling

UPSAMPLE = {
    "x2": ((1, 2, 3, 4), [6, 8], None),
    "down": ((2, 1, 7, 5), [3, 4], None),
    "odd_up": ((1, 2, 3, 5), [7, 9], None),
    "scales": ((1, 1, 4, 4), [9, 6], (2.3, 1.6)),
}


@pytest.mark.parametrize("name", list(UPSAMPLE))
def test_upsample_nearest2d(name):
    shape, size, scales = UPSAMPLE[name]
    x = randn(*shape)
    sc = scales or (None, None)
    check_rule(aten.upsample_nearest2d.default, x, size, *sc)
    g = randn(*shape[:2], *size)
    check_rule(aten.upsample_nearest2d_backward.default, g, size, list(shape), *sc)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("name", list(UPSAMPLE))
def test_upsample_bilinear2d(name, align_corners):
    shape, size, scales = UPSAMPLE[name]
    x = randn(*shape)
    sc = scales or (None, None)
    op = aten.upsample_bilinear2d.default
    check_rule(op, x, size, align_corners, *sc, rtol=1e-5, atol=1e-6)
    g = randn(*shape[:2], *size)
    bwd = aten.upsample_bilinear2d_backward.default
    check_rule(bwd, g, size, list(shape), align_corners, *sc, rtol=1e-5, atol=1e-5)


def test_upsample_bf16():
    x = randn(1, 2, 3, 4, dtype=torch.bfloat16)
    check_rule(aten.upsample_bilinear2d.default, x, [5, 7], False, **BF16)
    check_opt(aten.upsample_nearest2d.default, x, [6, 8])
