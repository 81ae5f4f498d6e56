"""Padding-free packing: ``torchacc_ops.flash_attention`` with ``cu_seqlens`` / ``position_ids``
(and TorchAcc's ``ta.ops.flash_attn_varlen_xla``) equals running each sequence on its own, output
and gradients, on the torchacc device and eagerly."""

import pytest
import torch
import torch.nn.functional as F

import torchacc as ta
import torchacc_ops

LENGTHS = (3, 5, 4)


def _qkv(heads=2, kv_heads=1, d=8):
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    return [torch.randn(1, h, total, d, generator=g) for h in (heads, kv_heads, kv_heads)]


def _one_by_one(q, k, v, causal):
    """Each sequence alone through SDPA, outputs concatenated; gradients w.r.t. q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    outs, start = [], 0
    for n in LENGTHS:
        part = [t[:, :, start : start + n] for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*part, is_causal=causal, enable_gqa=True))
        start += n
    out = torch.cat(outs, dim=2)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def _packed(q, k, v, causal, device, how):
    q, k, v = (t.detach().clone().to(device).requires_grad_(True) for t in (q, k, v))
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    if how == "cu_seqlens":
        out = torchacc_ops.flash_attention(q, k, v, causal=causal, cu_seqlens=cu.to(device))
    elif how == "position_ids":
        out = torchacc_ops.flash_attention(
            q, k, v, causal=causal, position_ids=positions.to(device)
        )
    else:
        flat = [t.squeeze(0).transpose(0, 1) for t in (q, k, v)]
        out = ta.ops.flash_attn_varlen_xla(*flat, cu, cu, 5, 5, causal=causal)
        out = out.transpose(0, 1).unsqueeze(0)
    weight = torch.linspace(-1, 1, out.numel()).view(out.shape).to(device)
    (out * weight).sum().backward()
    return out.detach().cpu(), [t.grad.cpu() for t in (q, k, v)]


@pytest.mark.parametrize("how", ["cu_seqlens", "position_ids", "flash_attn_varlen_xla"])
@pytest.mark.parametrize("device", ["torchacc", "cpu"])
def test_packed_attention_equals_each_sequence_alone(device, how):
    q, k, v = _qkv()
    for causal in (True, False):
        want, want_grads = _one_by_one(q, k, v, causal)
        dev = ta.device() if device == "torchacc" else torch.device("cpu")
        got, got_grads = _packed(q, k, v, causal, dev, how)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b, name in zip(got_grads, want_grads, "qkv", strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"grad of {name}")


def test_bad_packing_arguments_are_named():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-d integer tensor"):
        torchacc_ops.flash_attention(q, k, v, cu_seqlens=torch.tensor([0.0, 12.0]))
    with pytest.raises(ValueError, match="not both"):
        torchacc_ops.flash_attention(
            q, k, v, cu_seqlens=torch.tensor([0, 12]), position_ids=torch.zeros(1, 12)
        )
    with pytest.raises(ValueError, match=r"position_ids must be \(batch, 12\)"):
        torchacc_ops.flash_attention(q, k, v, position_ids=torch.zeros(12))
