"""Lowering rules of the linalg and fft families (torchacc/lowering/linalg.py, fft.py) against
eager PyTorch on CPU, and complex views written through on the device."""

from __future__ import annotations

import pytest
import torch
from lowering_harness import check_rule, run_rule

import torchacc
from torchacc import metrics

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5)


def _spd(*shape):
    a = torch.randn(*shape)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def test_cholesky_family_matches_eager():
    torch.manual_seed(0)
    a = _spd(2, 4, 4)
    check_rule(aten.linalg_cholesky_ex.default, a, **TOL)
    check_rule(aten.linalg_cholesky_ex.default, a, upper=True, **TOL)
    check_rule(aten.cholesky.default, a[0], True, **TOL)
    L = torch.linalg.cholesky(a)
    check_rule(aten.cholesky_inverse.default, L, **TOL)
    check_rule(aten.cholesky_inverse.default, L.mT, True, **TOL)
    check_rule(aten.cholesky_solve.default, torch.randn(2, 4, 3), L, **TOL)


def test_cholesky_info_flags_a_matrix_that_is_not_positive_definite():
    a = torch.stack([_spd(3, 3), -torch.eye(3)])
    _, info = run_rule(aten.linalg_cholesky_ex.default, a)
    assert info[0] == 0 and info[1] > 0  # eager: 1; see Note [Linalg info]


def test_lu_det_solve_inverse_match_eager_with_exact_info():
    torch.manual_seed(1)
    a = torch.randn(3, 5, 5)
    check_rule(aten._linalg_det.default, a, **TOL)
    check_rule(aten._linalg_slogdet.default, a, **TOL)
    check_rule(aten.linalg_inv_ex.default, a, **TOL)
    check_rule(aten.linalg_lu_factor_ex.default, a, **TOL)
    check_rule(aten.linalg_lu.default, torch.randn(4, 6), **TOL)
    check_rule(aten._linalg_solve_ex.default, a, torch.randn(3, 5, 2), **TOL)
    check_rule(aten._linalg_solve_ex.default, a, torch.randn(3, 5), **TOL)  # vector rhs
    check_rule(aten._linalg_solve_ex.default, a, torch.randn(3, 2, 5), left=False, **TOL)
    LU, piv = torch.linalg.lu_factor(a)
    check_rule(aten.lu_unpack.default, LU, piv, **TOL)
    check_rule(aten.linalg_lu_solve.default, LU, piv, torch.randn(3, 5, 2), **TOL)
    check_rule(aten.linalg_lu_solve.default, LU, piv, torch.randn(3, 5, 2), adjoint=True, **TOL)
    check_rule(aten.linalg_lu_solve.default, LU, piv, torch.randn(3, 2, 5), left=False, **TOL)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    _, info = run_rule(aten.linalg_inv_ex.default, singular)
    assert info == torch.linalg.inv_ex(singular).info  # LAPACK's index of the zero pivot
    check_rule(aten._linalg_det.default, torch.zeros(0, 0), **TOL)


def test_triangular_svd_qr_eig_pinv_lstsq_match_eager():
    torch.manual_seed(2)
    a = torch.randn(2, 4, 4) + 4 * torch.eye(4)
    b = torch.randn(2, 4, 3)
    check_rule(aten.linalg_solve_triangular.default, a.triu(), b, upper=True, **TOL)
    check_rule(
        aten.linalg_solve_triangular.default,
        a.tril(),
        b.mT,
        upper=False,
        left=False,
        unitriangular=True,
        **TOL,
    )
    check_rule(aten.triangular_solve.default, b, a.triu(), transpose=True, **TOL)
    s = run_rule(aten._linalg_svd.default, a)[1]
    torch.testing.assert_close(torch.from_numpy(s), torch.linalg.svdvals(a), **TOL)
    u, s, vh = (torch.from_numpy(x) for x in run_rule(aten._linalg_svd.default, a))
    torch.testing.assert_close(u @ torch.diag_embed(s) @ vh, a, **TOL)
    q, r = (torch.from_numpy(x) for x in run_rule(aten.linalg_qr.default, torch.randn(5, 3)))
    assert torch.allclose(q.mT @ q, torch.eye(3), atol=1e-5) and torch.equal(r, r.triu())
    sym = a + a.mT
    check_rule(aten._linalg_eigh.default, sym, compute_v=False, **TOL)
    w, v = (torch.from_numpy(x) for x in run_rule(aten._linalg_eigh.default, sym))
    torch.testing.assert_close(v @ torch.diag_embed(w) @ v.mT, sym, **TOL)
    w = torch.from_numpy(run_rule(aten.linalg_eig.default, a[0])[0])
    torch.testing.assert_close(
        w.abs().sort().values, torch.linalg.eigvals(a[0]).abs().sort().values
    )
    check_rule(aten.linalg_pinv.atol_rtol_tensor, torch.randn(3, 5, 4), **TOL)
    check_rule(aten.linalg_pinv.atol_rtol_tensor, sym.tril(), hermitian=True, **TOL)
    check_rule(aten.linalg_matrix_exp.default, a / 4, **TOL)
    tall = torch.randn(6, 3)
    check_rule(aten.linalg_lstsq.default, tall, torch.randn(6, 2), **TOL)
    check_rule(aten.linalg_lstsq.default, tall, torch.randn(6, 2), driver="gels", **TOL)


def test_lstsq_with_an_svd_driver_falls_back_by_name():
    torch.manual_seed(3)
    a, b = torch.randn(5, 3), torch.randn(5, 2)
    before = metrics.counter_value("aten::linalg_lstsq") or 0
    got = torch.linalg.lstsq(a.to(torchacc.device()), b.to(torchacc.device()), driver="gelsd")
    torch.testing.assert_close(got.solution.cpu(), torch.linalg.lstsq(a, b).solution, **TOL)
    assert metrics.counter_value("aten::linalg_lstsq") == before + 1


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_fft_rules_match_eager(norm):
    torch.manual_seed(4)
    x = torch.randn(3, 8, 6)
    check_rule(aten._fft_r2c.default, x, [1, 2], norm, True, **TOL)
    check_rule(aten._fft_r2c.default, x, [2], norm, False, **TOL)
    z = torch.randn(3, 8, 6, dtype=torch.complex64)
    check_rule(aten._fft_c2c.default, z, [0, 2], norm, True, **TOL)
    check_rule(aten._fft_c2c.default, z, [1], norm, False, **TOL)
    check_rule(aten._fft_c2r.default, z[..., :4], [1, 2], norm, 6, **TOL)
    check_rule(aten._fft_c2r.default, z[..., :4], [2], norm, 7, **TOL)


def test_complex_views_on_the_device_write_through():
    """complex/polar build, view_as_real/view_as_complex/conj view, and writes through each view
    reach the base: all lowered (no fallback)."""
    torch.manual_seed(5)
    dev = torchacc.device()
    re, im = torch.randn(4), torch.randn(4)
    before = set(metrics.executed_fallback_ops())
    z = torch.complex(re.to(dev), im.to(dev))
    torch.testing.assert_close(z.cpu(), torch.complex(re, im))
    torch.testing.assert_close(
        torch.polar(re.abs().to(dev), im.to(dev)).cpu(), torch.polar(re.abs(), im)
    )
    torch.testing.assert_close(z.sgn().cpu(), torch.complex(re, im).sgn())  # abs's gradient
    torch.view_as_real(z).mul_(2)  # the base sees the write
    torch.testing.assert_close(z.cpu(), torch.complex(re, im) * 2)
    c = z.conj()
    c.add_(1j)  # conj(z) + i  ->  z - i
    torch.testing.assert_close(z.cpu(), torch.complex(re, im) * 2 - 1j)
    r = torch.view_as_complex(torch.stack([re, im], -1).to(dev))
    torch.testing.assert_close(r.cpu(), torch.complex(re, im))
    torch.testing.assert_close(torch.fft.ifft(re.to(dev)).cpu(), torch.fft.ifft(re), **TOL)
    assert set(metrics.executed_fallback_ops()) == before


def test_complex32_fails_at_the_op_with_its_name():
    x = torch.randn(3).to(torchacc.device())
    with pytest.raises(TypeError, match=r"_to_copy.*complex32.*use torch.complex64"):
        x.chalf()


def test_det_and_slogdet_gradients_match_eager_for_contiguous_and_transposed_input():
    """Their backward solves with the saved LU, which eager takes of A^T for a contiguous A and of
    A otherwise: both layouts give eager's gradient."""
    torch.manual_seed(6)
    a = torch.randn(2, 4, 4)
    for layout in (lambda t: t, lambda t: t.mT):
        for fn in (torch.linalg.det, lambda t: torch.linalg.slogdet(t).logabsdet):
            x = a.clone().requires_grad_()
            fn(layout(x)).sum().backward()
            y = a.clone().to(torchacc.device()).requires_grad_()
            out = fn(layout(y))
            out.sum().backward()
            torch.testing.assert_close(out.cpu(), fn(layout(a)), **TOL)
            torch.testing.assert_close(y.grad.cpu(), x.grad, **TOL)


def test_stft_matches_eager_with_gradients():
    """torch.stft's composite transposes in place; torchacc's route does not (same values)."""
    torch.manual_seed(7)
    dev = torchacc.device()
    cases = [
        (torch.randn(2, 64), dict(n_fft=16, hop_length=4, return_complex=True)),
        (torch.randn(50), dict(n_fft=12, win_length=8, window=torch.hann_window(8),
                               center=False, normalized=True, return_complex=True)),
        (torch.randn(40), dict(n_fft=8, return_complex=False, onesided=False)),
        (torch.randn(40, dtype=torch.complex64), dict(n_fft=8, return_complex=True)),
    ]  # fmt: skip
    for x, kw in cases:
        xr, xd = x.clone().requires_grad_(), x.to(dev).requires_grad_()
        dkw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        want, got = torch.stft(xr, **kw), torch.stft(xd, **dkw)
        want.abs().sum().backward()
        got.abs().sum().backward()
        torch.testing.assert_close(got.cpu(), want, **TOL)
        torch.testing.assert_close(xd.grad.cpu(), xr.grad, **TOL)
