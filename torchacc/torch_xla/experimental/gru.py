"""``torch_xla.experimental.gru.GRU`` on torchacc: ``nn.GRU`` whose time loop on torchacc tensors
is one scan per layer (torchacc/lazy/scan.py), forward and backward.

``import torch_xla`` through the alias replaces ``torch.nn.GRU`` by this class, as torch_xla does
(the original stays at ``nn.GRU._orig``). On tensors of other devices its forward is nn.GRU's own,
and a bidirectional GRU (which it does not support) is built as the original class.
"""

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from torchacc.lazy.scan import scan
from torchacc.lazy.tensor import LazyTensor
from torchacc.torch_xla._api import differs

_GRU = nn.GRU  # torch's class, whatever nn.GRU is later


@differs("on tensors of other devices the forward is nn.GRU's own (same math, no scan)")
class GRU(_GRU):
    """A unidirectional ``nn.GRU`` whose forward scans each layer over time on torchacc."""

    def __new__(cls, *args, **kwargs):
        if kwargs.get("bidirectional", False):
            logging.warning(
                "torch_xla.experimental.gru.GRU: bidirectional GRUs use torch's nn.GRU instead"
            )
            return _GRU(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        if kwargs.get("proj_size", 0):
            raise ValueError(f"GRU: proj_size={kwargs['proj_size']} is not supported by nn.GRU")
        super().__init__(*args, **kwargs)

    def forward(self, input, hx=None):
        if type(input) is not LazyTensor or isinstance(input, PackedSequence):
            return _GRU.forward(self, input, hx)
        return _scan_forward(self, input, hx)


def _scan_forward(gru, input, hx):
    if input.dim() not in (2, 3):
        raise ValueError(f"GRU: expected a 2-D or 3-D input, got {input.dim()}-D")
    batched = input.dim() == 3
    if not batched:
        input = input.unsqueeze(0 if gru.batch_first else 1)
        if hx is not None:
            if hx.dim() != 2:
                raise RuntimeError(f"GRU: for a 2-D input hx must be 2-D, got {hx.dim()}-D")
            hx = hx.unsqueeze(1)
    elif hx is not None and hx.dim() != 3:
        raise RuntimeError(f"GRU: for a 3-D input hx must be 3-D, got {hx.dim()}-D")
    if hx is None:
        batch = input.size(0 if gru.batch_first else 1)
        hx = input.new_zeros(gru.num_layers, batch, gru.hidden_size)
    gru.check_forward_args(input, hx, None)
    if gru.batch_first:
        input = input.transpose(0, 1)
    out, finals = input, []
    for layer in range(gru.num_layers):
        carry = {
            "h": hx[layer],
            "w_ih": getattr(gru, f"weight_ih_l{layer}"),
            "w_hh": getattr(gru, f"weight_hh_l{layer}"),
        }
        if gru.bias:
            carry["b_ih"] = getattr(gru, f"bias_ih_l{layer}")
            carry["b_hh"] = getattr(gru, f"bias_hh_l{layer}")
        last, out = scan(_step, carry, out, is_fn_pure=True)
        finals.append(last["h"])
        if gru.dropout > 0 and layer < gru.num_layers - 1:
            out = F.dropout(out, p=gru.dropout, training=gru.training)
    hidden = torch.stack(finals)
    if gru.batch_first:
        out = out.transpose(0, 1)
    if not batched:
        out = out.squeeze(0 if gru.batch_first else 1)
        hidden = hidden.squeeze(1)
    return out, hidden


def _step(carry, x):
    """One time step (torch.nn.GRU's equations; gates in r, z, n order)."""
    h = carry["h"]
    xr, xz, xn = F.linear(x, carry["w_ih"], carry.get("b_ih")).chunk(3, dim=1)
    hr, hz, hn = F.linear(h, carry["w_hh"], carry.get("b_hh")).chunk(3, dim=1)
    r = torch.sigmoid(xr + hr)
    z = torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    h = (1 - z) * n + z * h
    return {**carry, "h": h}, h


def install():
    """``torch.nn.GRU`` becomes this class (idempotent), the original at ``nn.GRU._orig``."""
    if nn.GRU is not GRU:
        GRU._orig = nn.GRU
        nn.GRU = GRU


__all__ = ["GRU"]
