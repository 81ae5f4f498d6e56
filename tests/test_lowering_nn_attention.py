"""Attention lowering rules: the CPU flash op against eager PyTorch; the (CUDA-only) efficient op
against a PyTorch reference computed on CPU, dropout included (same keep mask)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from lowering_harness import check_rule, to_jax
from test_lowering_nn import BF16, check_opt, randn, run_opt

from torchacc.lowering import nn

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
EFF = aten._scaled_dot_product_efficient_attention.default
EFF_BWD = aten._scaled_dot_product_efficient_attention_backward.default


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def qkv(B=2, H=3, L=5, S=7, E=8, Hk=None, dtype=torch.float32):
    Hk = Hk or H
    return (
        randn(B, H, L, E, dtype=dtype),
        randn(B, Hk, S, E, dtype=dtype),
        randn(B, Hk, S, E, dtype=dtype),
    )


CASES = {
    "plain": (dict(), dict()),
    "causal": (dict(L=6, S=6), dict(is_causal=True)),
    "causal_cross": (dict(L=4, S=6), dict(is_causal=True)),
    "mask2d": (dict(), dict(attn_mask="2d")),
    "mask4d_scale": (dict(), dict(attn_mask="4d", scale=0.3)),
    "dead_row": (dict(), dict(attn_mask="dead")),
}


def _kwargs(spec, L=5, S=7):
    kw = dict(spec)
    m = kw.pop("attn_mask", None)
    if m == "2d":
        kw["attn_mask"] = randn(L, S)
    elif m == "4d":
        kw["attn_mask"] = randn(2, 1, L, S)
    elif m == "dead":
        mask = torch.zeros(L, S)
        mask[1] = -float("inf")  # a query that may attend to nothing
        mask[2, :3] = -float("inf")
        kw["attn_mask"] = mask
    return kw


@pytest.mark.parametrize("name", list(CASES))
def test_flash_attention_for_cpu(name):
    shape, spec = CASES[name]
    q, k, v = qkv(**shape)
    kw = _kwargs(spec, q.shape[2], k.shape[2])
    causal = kw.pop("is_causal", False)
    check_opt(FLASH, q, k, v, 0.0, causal, **kw, rtol=1e-5, atol=1e-5)
    out, lse = FLASH(q, k, v, 0.0, causal, **kw)
    g = randn(*out.shape)
    check_opt(FLASH_BWD, g, q, k, v, out, lse, 0.0, causal, **kw, rtol=1e-4, atol=1e-5)


def test_flash_attention_for_cpu_bf16():
    q, k, v = qkv(dtype=torch.bfloat16)
    check_rule(FLASH, q, k, v, 0.0, False, **BF16)
    out, lse = FLASH(q, k, v, 0.0, False)
    g = randn(*out.shape, dtype=torch.bfloat16)
    check_rule(FLASH_BWD, g, q, k, v, out, lse, 0.0, False, rtol=3e-2, atol=3e-2)


def _reference(q, k, v, bias=None, causal=False, scale=None, keep=None, p=0.0):
    """softmax(q k^T * scale + bias) (dropout: * keep / (1 - p)) v, in float64 torch autograd."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    b = bias.double().requires_grad_() if bias is not None else None
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -float("inf"))
    if b is not None:
        s = s + b
    lse = torch.logsumexp(s, -1)
    a = torch.softmax(s, -1)
    if keep is not None:
        a = a * torch.tensor(np.asarray(keep)) / (1 - p)
    return a @ v, lse, (q, k, v, b)


@pytest.mark.parametrize(
    "L,causal,bias,scale,p",
    [
        (5, False, False, None, 0.0),
        (6, True, False, 0.25, 0.0),
        (40, False, True, None, 0.0),
        (5, False, True, None, 0.3),
        (6, True, False, None, 0.5),
    ],
)
def test_efficient_attention(L, causal, bias, scale, p):
    q, k, v = qkv(L=L, S=L if causal else 7)
    b = randn(q.shape[0], q.shape[1], L, k.shape[2]) if bias else None
    (out, lse, seed, offset), metas = run_opt(EFF, q, k, v, b, True, p, causal, scale=scale)
    assert lse.shape == (2, 3, -(-L // 32) * 32) and seed.shape == () and offset.shape == ()
    keep = None
    if p:
        shape = q.shape[:-1] + (k.shape[2],)
        keep = nn.keep_mask(nn.dropout_key(jnp.asarray(seed)), shape, p)
        assert abs(float(jnp.mean(keep)) - (1 - p)) < 0.1
    ref, ref_lse, leaves = _reference(q, k, v, b, causal, scale, keep, p)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[..., :L], ref_lse.detach().numpy(), rtol=1e-5, atol=1e-5)

    g = randn(*out.shape)
    ref.backward(g.double())
    mask = [True, True, True, bias]
    args = (g, q, k, v, b, torch.tensor(out), torch.tensor(lse))
    args += (torch.tensor(seed), torch.tensor(offset), p, mask)
    grads, _ = run_opt(EFF_BWD, *args, causal, scale=scale)
    for got, leaf in zip(grads, leaves, strict=True):
        if leaf is None:
            assert got is None
            continue
        np.testing.assert_allclose(got, leaf.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_efficient_attention_no_lse_and_gqa():
    q, k, v = qkv(H=4, Hk=2)
    (out, lse, _, _), _ = run_opt(EFF, q, k, v, None, False)
    assert lse.shape == (2, 4, 0)
    ke, ve = (t.repeat_interleave(2, dim=1) for t in (k, v))
    ref, _, _ = _reference(q, ke, ve)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-5, atol=1e-5)
    # gradients of grouped kv heads sum over the query heads sharing them
    fwd = jax.jit(lambda q, k, v: nn.attention_forward(q, k, v, None, False, None)[0].sum())
    gq, gk, gv = jax.grad(fwd, argnums=(0, 1, 2))(*(to_jax(t) for t in (q, k, v)))
    _, lse, _, _ = nn.sdpa_efficient(*(to_jax(t) for t in (q, k, v)), None, True, rng=None)
    from torchacc.lowering.nn_backward import sdpa_efficient_backward

    res = sdpa_efficient_backward(
        jnp.ones(out.shape, jnp.float32),
        *(to_jax(t) for t in (q, k, v)),
        None,
        jnp.asarray(out),
        lse,
        None,
        None,
        0.0,
        [True] * 4,
    )
    for a, b in zip(res[:3], (gq, gk, gv), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert res[3] is None
