"""Factory ops with ``device=torchacc`` (no tensor argument) routed into the recorder.

The dispatcher picks a kernel for ``torch.empty(..., device=dev)`` from the device argument, so
these ops get PrivateUse1 kernels; composite factories (zeros, ones, full, rand, arange, ...) reach
them as ``empty`` followed by an in-place fill that the recorder handles like any op.
"""

import torch

from torchacc import dispatch

_lib = torch.library.Library("aten", "IMPL")
aten = torch.ops.aten


def _is_factory(op):
    """No tensor arguments and a ``device`` argument: the dispatcher picks by device."""
    args = op._schema.arguments
    return any(a.name == "device" for a in args) and not any("Tensor" in str(a.type) for a in args)


def _register_factories():
    from torchacc.lowering import RULES

    for op in list(RULES):
        if not _is_factory(op):
            continue

        def kernel(*args, _op=op, **kwargs):
            return dispatch.dispatch(_op, args, kwargs)

        _lib.impl(op, kernel, "PrivateUse1")


_register_factories()


def _copy_from(src, dst, non_blocking=False):
    """Host -> device copies made by torch itself (``torch.tensor(data, device=dev)``)."""
    return dispatch.dispatch(aten.copy_.default, (dst, src), {})


_lib.impl(aten._copy_from.default, _copy_from, "PrivateUse1")


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
