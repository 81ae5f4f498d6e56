"""Lowering rules added for issue 32 outside linalg/fft: special functions (bessel.py, the
polynomial families in special.py), segment ops (segments.py: embedding_bag forward/backward,
segment_reduce), mode and histogram (order.py), antialiased resize (resize.py) and fractional
max pooling (pooling.py), multinomial and rrelu (factory.py): against eager PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check_rule

import torchacc
from torchacc import metrics

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5)


def _no_new_fallbacks(fn):
    before = dict((n, metrics.counter_value(n)) for n in metrics.executed_fallback_ops())
    out = fn()
    after = dict((n, metrics.counter_value(n)) for n in metrics.executed_fallback_ops())
    assert after == before, f"fell back: {set(after.items()) - set(before.items())}"
    return out


_POLYNOMIALS = [
    "chebyshev_polynomial_t",
    "chebyshev_polynomial_u",
    "chebyshev_polynomial_v",
    "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t",
    "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w",
    "hermite_polynomial_h",
    "hermite_polynomial_he",
    "laguerre_polynomial_l",
    "legendre_polynomial_p",
]


@pytest.mark.parametrize("name", _POLYNOMIALS)
def test_polynomials_match_eager_for_mixed_degrees(name):
    """One program evaluates every element at its own degree (0..9, negative: 0, a float degree
    truncated); also the Scalar-x and Scalar-n overloads."""
    torch.manual_seed(0)
    packet = getattr(aten, f"special_{name}")
    x = torch.rand(40, dtype=torch.float64) * 1.8 - 0.9
    n = torch.randint(-1, 10, (40,)).double()
    n[0] = 2.7
    check_rule(packet.default, x, n, rtol=1e-6, atol=1e-8)
    check_rule(packet.n_scalar, x, 5, rtol=1e-6, atol=1e-8)
    check_rule(packet.x_scalar, 0.3, n, rtol=1e-6, atol=1e-8)


_BESSEL = {
    "bessel_j0": torch.special.bessel_j0,
    "bessel_j1": torch.special.bessel_j1,
    "bessel_y0": torch.special.bessel_y0,
    "bessel_y1": torch.special.bessel_y1,
    "modified_bessel_k0": torch.special.modified_bessel_k0,
    "modified_bessel_k1": torch.special.modified_bessel_k1,
    "scaled_modified_bessel_k0": torch.special.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": torch.special.scaled_modified_bessel_k1,
    "modified_bessel_i0": torch.special.modified_bessel_i0,
    "modified_bessel_i1": torch.special.modified_bessel_i1,
    "airy_ai": torch.special.airy_ai,
    "i0e": torch.special.i0e,
    "i1": torch.special.i1,
    "i1e": torch.special.i1e,
    "erfcx": torch.special.erfcx,
    "ndtri": lambda x: torch.special.ndtri(torch.sigmoid(x)),
    "spherical_bessel_j0": torch.special.spherical_bessel_j0,
}


def test_bessel_and_special_functions_match_eager_over_their_range():
    """float32 from -60 to 80 (both quadrature and asymptotic regimes, the poles at 0, NaN for
    negative arguments of Y and K), all on the device with no fallback."""
    x = torch.cat([torch.linspace(-60, 80, 1401), torch.tensor([0.0, 1e-6, 1e-3, float("nan")])])
    dev = torchacc.device()
    outs = _no_new_fallbacks(lambda: {k: fn(x.to(dev)).cpu() for k, fn in _BESSEL.items()})
    for name, fn in _BESSEL.items():
        torch.testing.assert_close(outs[name], fn(x), equal_nan=True, msg=name, **TOL)
    z = torch.tensor([1.5, 2.0, 3.5])
    q = torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(
        torch.special.zeta(z.to(dev), q.to(dev)).cpu(), torch.special.zeta(z, q)
    )


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_forward_and_backward_match_eager(mode):
    """nn.EmbeddingBag on the device (offsets with an empty bag, padding_idx, per-sample weights
    for sum, include_last_offset, 2-d input): output and weight gradient equal eager's."""
    torch.manual_seed(1)
    dev = torchacc.device()
    cases = [
        dict(input=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), offsets=torch.tensor([0, 4, 4])),
        dict(input=torch.tensor([1, 0, 4, 0, 4, 3]), offsets=torch.tensor([0, 2, 6]), last=True),
        dict(input=torch.randint(0, 10, (3, 4))),
    ]
    for case in cases:
        last = case.get("last", False)
        ref = torch.nn.EmbeddingBag(10, 3, mode=mode, padding_idx=0, include_last_offset=last)
        model = torch.nn.EmbeddingBag(10, 3, mode=mode, padding_idx=0, include_last_offset=last)
        model = model.to(dev)
        model.load_state_dict(ref.state_dict())
        kw = {}
        if mode == "sum":
            kw["per_sample_weights"] = torch.rand(case["input"].shape)
        offsets = case.get("offsets")
        want = ref(case["input"], offsets, **kw)
        (want * torch.arange(want.numel()).reshape(want.shape)).sum().backward()

        def run(model=model, case=case, offsets=offsets, kw=kw):
            got = model(
                case["input"].to(dev),
                None if offsets is None else offsets.to(dev),
                **{k: v.to(dev) for k, v in kw.items()},
            )
            weights = torch.arange(got.numel()).reshape(got.shape).to(dev)
            (got * weights).sum().backward()
            return got.cpu(), model.weight.grad.cpu()

        got, grad = _no_new_fallbacks(run)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(grad, ref.weight.grad, **TOL)


def test_embedding_bag_per_sample_weights_gradient_and_max_norm():
    torch.manual_seed(2)
    dev = torchacc.device()
    w = torch.randn(8, 3) * 3
    idx, off = torch.tensor([1, 2, 4, 7, 4]), torch.tensor([0, 2])
    psw = torch.rand(5, requires_grad=True)
    F.embedding_bag(idx, w, off, mode="sum", per_sample_weights=psw).sum().backward()
    psw_d = psw.detach().to(dev).requires_grad_()
    F.embedding_bag(
        idx.to(dev), w.to(dev), off.to(dev), mode="sum", per_sample_weights=psw_d
    ).sum().backward()
    torch.testing.assert_close(psw_d.grad.cpu(), psw.grad, **TOL)
    w_d = w.to(dev)
    got = F.embedding_bag(idx.to(dev), w_d, off.to(dev), max_norm=1.0)
    want = F.embedding_bag(idx, w, off, max_norm=1.0)  # renormalizes w's named rows in place
    torch.testing.assert_close(got.cpu(), want, **TOL)
    torch.testing.assert_close(w_d.cpu(), w, **TOL)


def test_segment_reduce_mode_histogram_match_eager():
    torch.manual_seed(3)
    data = torch.randn(6, 2)
    for reduce in ("sum", "mean", "max", "min", "prod"):
        for initial in (None, 1.5):
            check_rule(
                aten.segment_reduce.default,
                data,
                reduce,
                lengths=torch.tensor([2, 0, 3, 1]),
                initial=initial,
                **TOL,
            )
    check_rule(aten.segment_reduce.default, data, "mean", offsets=torch.tensor([0, 1, 1, 6]), **TOL)
    x = torch.randint(0, 4, (5, 9)).float()
    check_rule(aten.mode.default, x, **TOL)
    check_rule(aten.mode.default, x, 0, True, **TOL)
    v = torch.randn(50)
    check_rule(aten.histogram.bin_ct, v, 7, **TOL)
    check_rule(
        aten.histogram.bin_ct, v, 5, range=[-1.0, 1.0], weight=torch.rand(50), density=True, **TOL
    )
    check_rule(aten.histogram.bin_ct, torch.full((4,), 2.0), 3, **TOL)  # empty range widened
    check_rule(aten.histogram.bins_tensor, v, torch.tensor([-2.0, -0.5, 0.0, 3.0]), **TOL)


def test_antialiased_resize_and_fractional_max_pool_forward_and_backward():
    torch.manual_seed(4)
    dev = torchacc.device()
    x = torch.randn(2, 3, 10, 13)
    for size, align in (((4, 5), False), ((7, 20), False), ((3, 6), True)):
        xr, xd = x.clone().requires_grad_(), x.to(dev).requires_grad_()
        want = F.interpolate(xr, size=size, mode="bilinear", antialias=True, align_corners=align)
        got = F.interpolate(xd, size=size, mode="bilinear", antialias=True, align_corners=align)
        want.square().sum().backward()
        _no_new_fallbacks(lambda got=got: got.square().sum().backward())
        torch.testing.assert_close(got.cpu(), want, **TOL)
        torch.testing.assert_close(xd.grad.cpu(), xr.grad, **TOL)
    for nd, shape in ((2, (2, 3, 9, 11)), (3, (2, 2, 6, 7, 9))):
        pool = F.fractional_max_pool2d if nd == 2 else F.fractional_max_pool3d
        x = torch.randn(shape)
        samples = torch.rand(shape[0], shape[1], nd)
        xr, xd = x.clone().requires_grad_(), x.to(dev).requires_grad_()
        kw = dict(kernel_size=2, output_size=(4,) * nd, return_indices=True)
        want, want_i = pool(xr, _random_samples=samples, **kw)
        got, got_i = pool(xd, _random_samples=samples.to(dev), **kw)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(got.cpu(), want, **TOL)
        assert torch.equal(got_i.cpu(), want_i)
        torch.testing.assert_close(xd.grad.cpu(), xr.grad, **TOL)


def test_multinomial_and_rrelu_draw_on_the_device_with_the_right_law():
    torch.manual_seed(5)
    dev = torchacc.device()
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]])
    draws = _no_new_fallbacks(lambda: torch.multinomial(p.to(dev), 4000, True).cpu())
    freq = torch.stack([torch.bincount(r, minlength=4) for r in draws]) / 4000
    torch.testing.assert_close(freq, p, atol=0.03, rtol=0)
    distinct = torch.multinomial(p.to(dev), 3).cpu()
    assert all(len(set(r.tolist())) == 3 for r in distinct) and 1 not in distinct[0].tolist()
    x = torch.randn(2000)
    y = F.rrelu(x.to(dev), 0.1, 0.3, training=True).cpu()
    slope = (y / x)[x < 0]
    assert torch.equal(y[x >= 0], x[x >= 0]) and slope.min() >= 0.1 and slope.max() <= 0.3
    assert slope.std() > 0.03  # drawn per element
    torch.testing.assert_close(F.rrelu(x.to(dev), 0.1, 0.3).cpu(), F.rrelu(x, 0.1, 0.3))
