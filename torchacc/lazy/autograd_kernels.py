"""Kernels at the AutogradPrivateUse1 key: composite ops torchacc handles above autograd.

Note [Autograd-level kernels]
Most ops reach the recorder below autograd, already decomposed by PyTorch. For a few composite
layers that decomposition is long: ``F.linear`` on a 3-d input records ~5 ops forward and ~9
backward (views, transposes, mm, sum), each a full dispatch. Here ``linear`` is one autograd
Function whose forward records ``torchacc.linear`` and whose backward records
``torchacc.linear_backward``: one op each way, the same math for XLA, and far less host work per
step. With ``create_graph=True`` the backward is written with differentiable ops instead, so
double backward works. ``F.scaled_dot_product_attention`` is routed to the fused attention ops
(torch picks fused kernels through a C++-only hook a Python backend cannot provide).
``torch.stft`` is rebuilt from out-of-place ops (its composite resizes a tensor in place).
"""

import torch

from torchacc.lazy import fused_kernels
from torchacc.lazy.record import direct_apply
from torchacc.lowering import custom_ops as ops

_lib = torch.library.Library("aten", "IMPL")
aten = torch.ops.aten


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        return ops.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            flat = grad.reshape(-1, grad.shape[-1])
            return (
                grad.matmul(weight) if need_input else None,
                flat.t().mm(input.reshape(-1, input.shape[-1])) if need_weight else None,
                flat.sum(0) if need_bias else None,
            )
        # unused outputs are never program outputs, so XLA drops their computation
        g_input, g_weight, g_bias = ops.linear_backward(grad, input, weight)
        return (
            g_input if need_input else None,
            g_weight if need_weight else None,
            g_bias if need_bias else None,
        )


_linear_apply = direct_apply(_Linear)


def _linear(input, weight, bias=None):
    if torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _linear_apply(input, weight, bias)
    return ops.linear(input, weight, bias)


_lib.impl(aten.linear.default, _linear, "AutogradPrivateUse1")


# F.scaled_dot_product_attention: torch consults a C++-only hook to pick a fused kernel, which a
# Python backend cannot provide, so without this it always takes the math path (many small ops).
# At the autograd key we route it to the fused attention op (Note [Fused kernels] in
# fused_kernels.py): one op each way, cuDNN on XLA:GPU where it can serve the call.
_sdpa = aten.scaled_dot_product_attention.default


def _attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if (
        query.dim() != 4
        or key.dim() != 4
        or value.dim() != 4
        or (is_causal and attn_mask is not None)  # torch's error
        or (not enable_gqa and key.shape[1] != query.shape[1])  # torch's error
    ):
        return _sdpa.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    return fused_kernels.attention(query, key, value, attn_mask, dropout_p, is_causal, scale)


_lib.impl(_sdpa, _attention, "AutogradPrivateUse1")


# F.rms_norm over the last dimension: the fused RMSNorm op (Note [Fused kernels]); PyTorch's
# composite records ~6 ops forward and more backward.
_rms_norm = aten.rms_norm.default


def _rms_norm_route(input, normalized_shape, weight=None, eps=None):
    if len(normalized_shape) != 1:
        return _rms_norm.decompose(input, normalized_shape, weight, eps)
    return fused_kernels.rms_norm(input, weight, eps)


_lib.impl(_rms_norm, _rms_norm_route, "AutogradPrivateUse1")


# torch.stft: its composite transposes the FFT's result in place (``transpose_``), which a device
# tensor cannot do (its shape is fixed). The same frames -> window -> FFT -> transpose with
# out-of-place, differentiable ops.
_stft = aten.stft.default


def _stft_route(
    self,
    n_fft,
    hop_length=None,
    win_length=None,
    window=None,
    normalized=False,
    onesided=None,
    return_complex=None,
    align_to_window=None,
):
    args = (hop_length, win_length, window, normalized, onesided, return_complex, align_to_window)
    if align_to_window or return_complex is None or self.dim() not in (1, 2):
        return _stft.decompose(self, n_fft, *args)  # torch's own errors and rarer options
    hop = hop_length or n_fft // 4
    win = win_length or n_fft
    x = self if self.dim() == 2 else self.unsqueeze(0)
    w = torch.ones(win, dtype=x.real.dtype, device=x.device) if window is None else window
    if win < n_fft:  # a shorter window is centered in the frame
        left = (n_fft - win) // 2
        w = torch.nn.functional.pad(w, (left, n_fft - win - left))
    frames = x.unfold(-1, n_fft, hop) * w
    if onesided is None:
        onesided = not (x.is_complex() or w.is_complex())
    spec = torch.fft.rfft(frames, dim=-1) if onesided else torch.fft.fft(frames, dim=-1)
    if normalized:
        spec = spec * n_fft**-0.5
    spec = spec.transpose(1, 2)
    if not return_complex:
        spec = torch.view_as_real(spec)
    return spec if self.dim() == 2 else spec.squeeze(0)


_lib.impl(_stft, _stft_route, "AutogradPrivateUse1")
