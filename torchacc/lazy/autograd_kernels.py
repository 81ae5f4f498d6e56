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
"""

import torch

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


def _linear(input, weight, bias=None):
    if torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _Linear.apply(input, weight, bias)
    return ops.linear(input, weight, bias)


_lib.impl(aten.linear.default, _linear, "AutogradPrivateUse1")


# F.scaled_dot_product_attention: torch consults a C++-only hook to pick a fused kernel, which a
# Python backend cannot provide, so without this it always takes the math path (many small ops).
# At the autograd key we route it to the attention ops that have lowerings (and backward formulas).
_sdpa = aten.scaled_dot_product_attention.default


def _attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if enable_gqa or query.dim() != 4:
        return _sdpa.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(
            attn_mask.shape, dtype=query.dtype, device=query.device
        ).masked_fill(attn_mask.logical_not(), float("-inf"))
    if dropout_p == 0.0 and (attn_mask is None or not attn_mask.requires_grad):
        return aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    needs_grad = any(t is not None and t.requires_grad for t in (query, key, value, attn_mask))
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
    )[0]


_lib.impl(_sdpa, _attention, "AutogradPrivateUse1")
