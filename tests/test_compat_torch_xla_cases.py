"""Cases from torch_xla's own unit tests (pytorch/xla test/test_operations.py) that fit one device
per process, rewritten against eager CPU, plus torch_xla's leniency for float class targets
(torchacc/lazy/lenient.py). The README's "torch_xla test cases" list names each one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchacc

DEV = torchacc.device()


def _same(fn, *inputs, **tol):
    want = fn(*[x.clone() for x in inputs])
    got = fn(*[x.to(DEV) for x in inputs])
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, **tol)


# --- torch_xla is lenient: float class-index targets -------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(6, 5), (2, 5, 3, 4)], ids=["1d", "2d"])
def test_cross_entropy_and_nll_accept_float_class_targets(shape, reduction):
    torchacc.metrics.clear_all()  # fallbacks an earlier test on this worker ran are not ours
    torch.manual_seed(0)
    x = torch.randn(shape)
    target = torch.randint(0, 5, (shape[0],) + shape[2:])
    target[0] = -100  # ignore_index still works
    for loss in (
        lambda a, t: F.cross_entropy(a, t, reduction=reduction),
        lambda a, t: F.nll_loss(F.log_softmax(a, 1), t, reduction=reduction),
        lambda a, t: nn.CrossEntropyLoss(weight=torch.arange(1.0, 6.0).to(a.device))(a, t),
    ):
        xe = x.clone().requires_grad_()
        want = loss(xe, target)  # eager needs int64 targets
        want.sum().backward()
        xa = x.to(DEV).requires_grad_()
        got = loss(xa, target.float().to(DEV))  # torch_xla's scripts pass float targets
        got.sum().backward()
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xa.grad.cpu(), xe.grad, rtol=1e-5, atol=1e-6)
    assert torchacc.metrics.executed_fallback_ops() == []


def test_eager_cpu_still_rejects_float_targets():
    """The leniency is torchacc's device only: CPU tensors keep torch's check."""
    with pytest.raises(RuntimeError):
        F.nll_loss(torch.randn(3, 4), torch.tensor([0.0, 1.0, 2.0]))


# --- torch_xla's unit tests, one device -----------------------------------------------------------


@pytest.mark.parametrize("target", [[0, 0], [0, 1], [1, 0], [1, 1]])
def test_nll_loss_inf_and_nan_logits(target):  # TestNllLossLimitValue
    inf, nan = float("inf"), float("nan")
    t = torch.tensor(target)
    for logits in (torch.tensor([[1.0, inf], [-inf, 2.0]]), torch.tensor([[1.0, nan], [nan, 2.0]])):
        _same(lambda a, b: F.nll_loss(a, b), logits, t)


@pytest.mark.parametrize("offset", [1, 0, 1e-8, 1e-7])
def test_bce_loss_at_the_limit(offset):  # TestBinaryCrossEntropyLimitValue
    _same(lambda p, t: nn.BCELoss()(p, t), torch.tensor(1.0) - offset, torch.tensor(1.0))


def test_op_without_lowering_between_lowered_ops():  # TestInterOpSyncTensors
    _same(lambda x: torch.masked_select(torch.logaddexp(x, x), torch.logaddexp(x, x).eq(0)),
          torch.tensor([1.0, 2.0, 3.0]))  # fmt: skip


def test_nan_to_num_in_place_with_inf():  # test_nan_to_num_in_place(_with_inf)
    def fn(x):
        x.nan_to_num_(1.0, 2.0, 3.0)
        return x

    _same(fn, torch.tensor([float("nan"), float("inf"), -float("inf"), 3.14]))


def test_negative_slice_and_cat_and_cat_with_legacy_empty():  # test_negative_slice/cat, cat_empty
    t = torch.randn(2, 5, 3)
    _same(lambda x: x[:, :, -1], t)
    _same(lambda x: torch.cat([x, x], -1), t)
    _same(lambda x, e: torch.cat([x, e], 0), t, torch.Tensor())


def test_long_graph_chain():  # TestLongGraphChain (2000 ops recorded before one sync)
    def fn(x, y):
        for _ in range(2000):
            x = x + 2 * y
        return x

    _same(fn, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.1, 0.2], [0.3, 0.4]]))


@pytest.mark.parametrize("bounds", [(0, 1), (0, 2), (1, 2)])
def test_random_from_to(bounds):  # TestRandom.test_random_from_to_bool
    lo, hi = bounds
    x = torch.randn(10, device=DEV)
    x.random_(lo, hi)
    v = x.to(torch.int).cpu()
    assert lo <= int(v.min()) and int(v.max()) < hi


def test_amp_non_finite_check_and_unscale():  # test_amp_foreach_non_finite_check_and_unscale_
    for grads, found in (([1.0, 2.0, 3.0, 4.0], 0.0), ([1.0, 2.0, float("nan"), 4.0], 1.0)):
        g = torch.tensor(grads).to(DEV)
        found_inf = torch.tensor(0.0).to(DEV)
        torch._amp_foreach_non_finite_check_and_unscale_([g], found_inf, torch.tensor(0.2).to(DEV))
        assert float(found_inf.cpu()) == found
        if not found:
            torch.testing.assert_close(g.cpu(), torch.tensor(grads) * 0.2)


# --- GradScaler's device kernels against torch's CPU kernels, boundary values included ----------

_INF, _NAN = float("inf"), float("nan")


def _amp_grads():
    """Scaled gradients as a mixed-precision model has them: a view into a larger buffer (its
    neighbours must not change), a transposed view, half types, float64; -0.0 and values that
    overflow fp16 once scaled up."""
    base = torch.tensor([7.0, 1.0, -0.0, 3.0e-8, -2.5, 7.0])
    return [
        base,
        torch.tensor([[1.0, -0.0, 6.0e4], [-3.0, 0.5, 2.0]], dtype=torch.float16).t(),
        torch.tensor([0.5, -0.0, 1.0e38, -8.0], dtype=torch.bfloat16),
        torch.tensor([1.0e-300, -0.0, 4.0], dtype=torch.float64),
    ]


def _assert_same_bits(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)  # -0.0 stays -0.0


@pytest.mark.parametrize(
    "poison, inv_scale, found_before",
    [
        (None, 0.2, 0.0),  # finite: found_inf stays 0; 0.2 rounds differently in fp16
        (_INF, 0.25, 0.0),
        (-_INF, 2.0**-16, 0.0),
        (_NAN, 0.25, 0.0),
        (None, 4.0, 0.0),  # scaling up: 6e4 overflows fp16 in the result, not in the check
        (None, 0.25, 1.0),  # a set found_inf is never reset (several optimizers accumulate)
        (None, 1.0, 0.0),
    ],
    ids=["finite", "inf", "-inf", "nan", "scale-up", "found-kept", "unit"],
)
def test_amp_unscale_matches_torch_with_boundary_values(poison, inv_scale, found_before):
    from torchacc import metrics

    grads = _amp_grads()
    if poison is not None:
        grads[3][1] = poison  # the last list element, so no early exit can skip it
    ref = [g.clone() for g in grads]
    ref_found, inv = torch.tensor(found_before), torch.tensor(inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv)

    base = torch.cat([torch.tensor([9.0]), grads[0]]).to(DEV)
    dev = [base[1:], *(g.to(DEV) for g in grads[1:])]
    dev[1] = grads[1].t().contiguous().to(DEV).t()  # a transposed view on the device too
    found = torch.tensor(found_before).to(DEV)
    dinv = inv.to(DEV)
    torchacc.sync()
    transfers = metrics.counter_value("TransferFromDevice") or 0
    fallbacks = metrics.executed_fallback_ops()
    torch._amp_foreach_non_finite_check_and_unscale_(dev, found, dinv)
    torchacc.sync()
    assert (metrics.counter_value("TransferFromDevice") or 0) == transfers  # no host read
    assert metrics.executed_fallback_ops() == fallbacks  # recorded, not run on the CPU
    assert found.cpu().item() == ref_found.item()
    for got, want in zip(dev, ref, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        _assert_same_bits(got.cpu(), want)
    assert base[0].cpu().item() == 9.0  # the view's neighbour is untouched


def test_amp_unscale_rejects_what_torch_rejects():
    g = [torch.ones(3).to(DEV)]
    one = torch.ones(()).to(DEV)
    with pytest.raises(RuntimeError, match="found_inf must be a 1-element float32 tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(
            g, torch.zeros((), dtype=torch.int64).to(DEV), one
        )
    with pytest.raises(RuntimeError, match="inv_scale must be a 1-element float32 tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(g, torch.zeros(()).to(DEV), one.double())
    ints = [torch.ones(3, dtype=torch.int32).to(DEV)]
    with pytest.raises(RuntimeError, match=r"grads\[0\] is torch.int32"):
        torch._amp_foreach_non_finite_check_and_unscale_(ints, torch.zeros(()).to(DEV), one)


def test_amp_update_scale_matches_torch():
    """``torch._amp_update_scale_`` writes both the scale and the growth tracker, on the device:
    growth every ``growth_interval`` clean steps, backoff and tracker reset on inf, and a scale
    that would grow past float32's range kept."""
    from torchacc import metrics

    found_seq = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    for start, growth, backoff, interval in [
        (8.0, 2.0, 0.5, 2),
        (777.7, 1.7, 0.3, 3),
        (3e38, 2.0, 0.5, 1),
    ]:
        scale, tracker = torch.tensor(start), torch.tensor(0, dtype=torch.int32)
        dscale, dtracker = scale.to(DEV), tracker.to(DEV)
        dfound = [torch.tensor(f).to(DEV) for f in found_seq]
        torchacc.sync()
        transfers = metrics.counter_value("TransferFromDevice") or 0
        want, got = [], []
        for f, df in zip(found_seq, dfound, strict=True):
            out = torch._amp_update_scale_(
                scale, tracker, torch.tensor(f), growth, backoff, interval
            )
            dout = torch._amp_update_scale_(dscale, dtracker, df, growth, backoff, interval)
            assert out is scale and dout is dscale
            want.append((scale.item(), tracker.item()))
            got.append((dscale.clone(), dtracker.clone()))
        torchacc.sync()
        assert (metrics.counter_value("TransferFromDevice") or 0) == transfers
        assert [(s.cpu().item(), t.cpu().item()) for s, t in got] == want
        assert dtracker.dtype == torch.int32
