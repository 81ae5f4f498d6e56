"""Dense linear algebra: decompositions (Cholesky, LU, QR, SVD, eigh, eig), solvers, inverses,
determinants and the pseudo-inverse, as ``jax.lax.linalg`` / ``jnp.linalg`` programs.

Half floats compute in float32. Each ``info`` output follows LAPACK's meaning where XLA gives
enough to say it (see Note [Linalg info]); the ``_ex`` ops never raise, as in eager.
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import torch
from jax import lax

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.registry import register

aten = torch.ops.aten

# Note [Linalg info]
# LAPACK reports a failed factorization in an int32 ``info`` per matrix: for LU (getrf), the
# 1-based index of the first exactly-zero pivot of U; for Cholesky (potrf), the order of the
# first leading minor that is not positive definite. The LU info here is computed the same way
# from the factor's diagonal, so it equals eager's. XLA's Cholesky does not stop at the failing
# minor: it returns a factor full of NaN, so the Cholesky info here is 1 + the index of the first
# non-finite diagonal entry (1 whenever the input is not positive definite, on the CPU), and 0 for
# success exactly as in eager. ``linalg.cholesky``/``inv``/``solve`` (without ``_ex``) check
# ``info`` with ``aten._linalg_check_errors``, which reads it on the host (a sync, as eager CUDA
# does); the ``_ex`` ops leave that to the caller.


def _f(x):
    return opmath(x)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _lu(a):
    """LU with partial pivoting: (LU, 1-based int32 pivots, permutation, info) as LAPACK gives."""
    lu, piv, perm = lax.linalg.lu(a)
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    info = jnp.zeros(a.shape[:-2], jnp.int32)
    if zero.shape[-1]:  # (argmax of an empty matrix's diagonal is undefined)
        info = jnp.where(jnp.any(zero, -1), jnp.argmax(zero, -1) + 1, 0).astype(jnp.int32)
    return lu, (piv + 1).astype(jnp.int32), perm, info


def _lu_det(lu, piv):
    """(sign of the permutation times the product of U's diagonal signs, log|det|, det)."""
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    n = diag.shape[-1]
    swaps = jnp.sum(piv != jnp.arange(1, n + 1, dtype=piv.dtype), -1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(lu.dtype)
    det = parity * jnp.prod(diag, -1)
    sign = parity * jnp.prod(diag / jnp.where(diag == 0, 1, jnp.abs(diag)), -1)
    sign = jnp.where(jnp.any(diag == 0, -1), 0, sign)
    return sign, jnp.sum(jnp.log(jnp.abs(diag)), -1), det


# det and slogdet factor A^T, as eager does for a contiguous real A (and their backward expects);
# the lazy frontend passes any other A transposed (lazy/dispatch.py, _lu_of_transpose).


@register(aten._linalg_det.default)
def linalg_det(A):
    lu, piv, _, _ = _lu(_mT(_f(A)))
    return _lu_det(lu, piv)[2], lu, piv


@register(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, piv, _, _ = _lu(_mT(_f(A)))
    sign, logabs, _ = _lu_det(lu, piv)
    return sign, logabs, lu, piv


def _cholesky_info(L):
    bad = ~jnp.isfinite(jnp.diagonal(L, axis1=-2, axis2=-1))
    if not bad.shape[-1]:
        return jnp.zeros(L.shape[:-2], jnp.int32)
    return jnp.where(jnp.any(bad, -1), jnp.argmax(bad, -1) + 1, 0).astype(jnp.int32)


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, upper=False, check_errors=False):
    L = jnp.tril(lax.linalg.cholesky(_f(self), symmetrize_input=False))
    return (_mH(L) if upper else L), _cholesky_info(L)


def cholesky(self, upper=False):
    L = jnp.tril(lax.linalg.cholesky(_f(self), symmetrize_input=False))
    return _mH(L) if upper else L


if hasattr(aten, "cholesky"):  # torch 2.14 removed the deprecated aten::cholesky
    register(aten.cholesky.default)(cholesky)


def _tri_inv(t, lower):
    eye = jnp.broadcast_to(jnp.eye(t.shape[-1], dtype=t.dtype), t.shape)
    return lax.linalg.triangular_solve(t, eye, left_side=True, lower=lower)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    """(L L^H)^-1 = L^-H L^-1 (``upper``: (U^H U)^-1 = U^-1 U^-H)."""
    inv = _tri_inv(_f(self), lower=not upper)
    return inv @ _mH(inv) if upper else _mH(inv) @ inv


def _broadcast_batch(a, b, b_vector=False):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[: b.ndim - (1 if b_vector else 2)])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    tail = b.shape[-1:] if b_vector else b.shape[-2:]
    return a, jnp.broadcast_to(b, batch + tail)


@register(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper=False):
    c, b = _broadcast_batch(_f(input2), _f(self))
    return jsl.cho_solve((c, not upper), b)


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, upper, left=True, unitriangular=False):
    a, b = _broadcast_batch(_f(self), _f(B))
    return lax.linalg.triangular_solve(
        a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular
    )


@register(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    a, b = _broadcast_batch(_f(A), _f(self))
    x = lax.linalg.triangular_solve(
        a, b, left_side=True, lower=not upper, transpose_a=transpose, unit_diagonal=unitriangular
    )
    return x, a


def _lu_solve(lu, perm, b, left=True, adjoint=False):
    """Solve op(A) X = B (``left``) or X op(A) = B with A = P^T L U from ``_lu``."""
    if not left:  # X A = B  <=>  A^H X^H = B^H
        return _mH(_lu_solve(lu, perm, _mH(b), True, not adjoint))
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    if not adjoint:
        pb = jnp.take_along_axis(b, perm[..., None], axis=-2)
        y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True,
                                    conjugate_a=True)  # fmt: skip
    z = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True,
                                    conjugate_a=True, unit_diagonal=True)  # fmt: skip
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inv[..., None], axis=-2)


def _is_vector_rhs(A, B):
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@register(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, left=True, check_errors=False):
    a = _f(A)
    lu, piv, perm, info = _lu(a)
    b = _f(B)
    vector = _is_vector_rhs(A, B)
    x = _lu_solve(lu, perm, b[..., None] if vector else b, left)
    return (x[..., 0] if vector else x), lu, piv, info


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, check_errors=False):
    lu, _, perm, info = _lu(_f(A))
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=lu.dtype), lu.shape)
    return _lu_solve(lu, perm, eye), info


@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("torchacc: linalg.lu_factor(pivot=False) is not lowered")
    lu, piv, _, info = _lu(_f(A))
    return lu, piv, info


def _perm_matrix(perm, m, dtype):
    """P with A = P L U, from the row permutation ``perm`` (A[perm] = L U)."""
    return _mT(jnp.eye(m, dtype=dtype)[perm])


def _unpack(lu, perm, dtype):
    m, n = lu.shape[-2:]
    k = min(m, n)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    U = jnp.triu(lu[..., :k, :])
    return _perm_matrix(perm, m, dtype), L, U


@register(aten.linalg_lu.default)
def linalg_lu(A, pivot=True):
    if not pivot:
        raise NotImplementedError("torchacc: linalg.lu(pivot=False) is not lowered")
    lu, _, perm, _ = _lu(_f(A))
    return _unpack(lu, perm, lu.dtype)


def _pivots_to_perm(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


@register(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m = LU_data.shape[-2]
    P, L, U = _unpack(LU_data, _pivots_to_perm(LU_pivots, m), LU_data.dtype)
    if not unpack_pivots:
        P = jnp.zeros((0,), LU_data.dtype)
    if not unpack_data:
        L = U = jnp.zeros((0,), LU_data.dtype)
    return P, L, U


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, left=True, adjoint=False):
    perm = _pivots_to_perm(pivots, LU.shape[-2])
    return _lu_solve(_f(LU), perm, _f(B), left, adjoint)


@register(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    a = _f(A)
    if not compute_uv:
        s = jnp.linalg.svd(a, compute_uv=False)
        return jnp.zeros((0,), a.dtype), s, jnp.zeros((0,), a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return u, s, vh


@register(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    a = _f(A)
    a = jnp.tril(a) if UPLO == "L" else jnp.triu(a)
    a = a + _mH(jnp.tril(a, -1) if UPLO == "L" else jnp.triu(a, 1))
    v, w = lax.linalg.eigh(a, lower=UPLO == "L", symmetrize_input=False)
    if not compute_v:
        return w, jnp.zeros((0,), a.dtype)
    return w, v


@register(aten.linalg_eig.default)
def linalg_eig(self):
    """General eigendecomposition (complex results), JAX's ``eig`` (LAPACK geev on the CPU; on a
    GPU only where the installed jaxlib implements it: not checked here, no GPU was lent)."""
    w, vr = lax.linalg.eig(_f(self), compute_left_eigenvectors=False)
    return w, vr


@register(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    a = _f(A)
    if mode == "r":
        return jnp.zeros((0,), a.dtype), jnp.linalg.qr(a, mode="r")
    q, r = jnp.linalg.qr(a, mode=mode)
    return q, r


@register(aten.geqrf.default)
def geqrf(self):
    from jax._src.lax.linalg import geqrf as _geqrf  # not re-exported by jax.lax.linalg

    a, taus = _geqrf(_f(self))
    return a, taus


@register(aten.linalg_householder_product.default)
def linalg_householder_product(input, tau):
    return lax.linalg.householder_product(_f(input), _f(tau))


@register(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    return lax.linalg.ormqr(_f(self), _f(input2), _f(input3), left=left, transpose=transpose)


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    return jsl.expm(_f(self))


def _pinv(a, atol, rtol, hermitian):
    """Pseudo-inverse with torch's cut-off: singular values <= max(atol, rtol * s_max) drop
    (rtol defaults to eps * max(m, n) when neither tolerance is given, else to 0)."""
    m, n = a.shape[-2:]
    if rtol is None:
        rtol = jnp.finfo(a.dtype).eps * max(m, n) if atol is None else 0.0
    atol = 0.0 if atol is None else atol
    if hermitian:
        v, w = lax.linalg.eigh(a, lower=True, symmetrize_input=False)  # eager reads L only
        s = jnp.abs(w)
        cut = jnp.maximum(jnp.asarray(atol), jnp.asarray(rtol) * jnp.max(s, -1))[..., None]
        inv = jnp.where(s > cut, 1 / jnp.where(s > cut, w, 1), 0)
        return (v * inv[..., None, :].astype(v.dtype)) @ _mH(v)
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    cut = jnp.maximum(jnp.asarray(atol), jnp.asarray(rtol) * jnp.max(s, -1, initial=0))[..., None]
    inv = jnp.where(s > cut, 1 / jnp.where(s > cut, s, 1), 0).astype(a.dtype)
    return (_mH(vh) * inv[..., None, :]) @ _mH(u)


@register(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.atol_rtol_float)
def linalg_pinv(self, atol=None, rtol=None, hermitian=False):
    return _pinv(_f(self), atol, rtol, hermitian)


@register(aten.linalg_pinv.default, aten.linalg_pinv.rcond_tensor)
def linalg_pinv_rcond(self, rcond, hermitian=False):
    return _pinv(_f(self), 0.0, rcond, hermitian)


@register(aten.linalg_lstsq.default, out_meta=True, static=("rcond",))
def linalg_lstsq(self, b, rcond=None, driver=None, *, out):
    """Least squares, the minimum-norm solution (as LAPACK's gelsy) from the SVD; ``rank`` counts
    singular values above rcond * s_max (rcond defaults to eps * max(m, n)). Drivers gelsy
    (the default) and gels; the others have data-dependent output shapes (see metas.py)."""
    a = _f(self)
    m, n = a.shape[-2:]
    vector = b.ndim == a.ndim - 1
    a, rhs = _broadcast_batch(a, _f(b)[..., None] if vector else _f(b))
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    cut = jnp.finfo(a.dtype).eps * max(m, n) if rcond is None or rcond < 0 else rcond
    keep = s > cut * jnp.max(s, -1, keepdims=True, initial=0)
    inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0)
    x = _mH(vh) @ (inv[..., None] * (_mH(u) @ rhs))
    solution = x[..., 0] if vector else x
    rank = jnp.sum(keep, -1).astype(jnp.int64)
    empty = jnp.zeros((0,), a.dtype)
    if (driver or "gelsy") == "gels":
        res = jnp.zeros((0,), a.dtype)
        if m > n:
            res = jnp.sum(jnp.abs(a @ x - rhs) ** 2, axis=-2)
            res = res[..., 0] if vector else res
        return solution, res, jnp.zeros((0,), jnp.int64), empty
    return solution, empty, rank, empty
