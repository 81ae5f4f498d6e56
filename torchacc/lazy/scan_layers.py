"""``scan_layers(layers, input_data)``: a stack of identical layers as one scan (lazy/scan.py).

The layers' parameters and buffers are stacked along a new leading dimension (``torch.stack``, so
each layer's own parameters get their gradients back through it) and the first layer runs as the
scanned function with each layer's slice put in place by ``torch.func.functional_call``. Layers
must agree in type, parameter and buffer names and shapes: a ``ValueError`` names the layer and
the two shapes otherwise, before anything is recorded. Buffers are read, not written, by the
scanned layer (a running-statistics update inside ``fn`` is not supported).
"""

from __future__ import annotations

import torch

from torchacc.lazy.scan import scan

_one_layer_fns: dict = {}  # (id(first layer), partition_fn) -> fn, for is_layer_pure


def scan_layers(layers, input_data, partition_fn=None, is_layer_pure=False):
    """Run ``layers`` in order on ``input_data`` (as ``nn.Sequential(*layers)(input_data)``),
    as one scan over their stacked weights."""
    layers = list(layers)
    if not layers:
        return input_data
    params = [dict(layer.named_parameters()) for layer in layers]
    buffers = [dict(layer.named_buffers()) for layer in layers]
    _check_same_structure(layers, params, buffers)
    stacked = (_stack(params), _stack(buffers))
    fn = _one_layer_fn(layers[0], partition_fn, is_layer_pure)
    return scan(fn, input_data, stacked, partition_fn=partition_fn, is_fn_pure=is_layer_pure)[0]


def _stack(dicts):
    return {k: torch.stack([d[k] for d in dicts]) for k in dicts[0]}


def _check_same_structure(layers, params, buffers):
    first = layers[0]
    for i, layer in enumerate(layers[1:], start=1):
        if type(layer) is not type(first):
            raise ValueError(
                f"scan_layers: layer {i} is a {type(layer).__name__}, layer 0 a "
                f"{type(first).__name__}; all layers must have the same structure"
            )
        for kind, dicts in (("parameter", params), ("buffer", buffers)):
            ref, cur = dicts[0], dicts[i]
            if set(ref) != set(cur):
                missing, extra = sorted(set(ref) - set(cur)), sorted(set(cur) - set(ref))
                raise ValueError(
                    f"scan_layers: layer {i}'s {kind}s differ from layer 0's (missing {missing}, "
                    f"extra {extra})"
                )
            for name, t in ref.items():
                if t.shape != cur[name].shape or t.dtype != cur[name].dtype:
                    raise ValueError(
                        f"scan_layers: {kind} {name!r} of layer {i} has shape "
                        f"{tuple(cur[name].shape)} {cur[name].dtype}, layer 0's "
                        f"{tuple(t.shape)} {t.dtype}"
                    )
                if t.device != cur[name].device:
                    raise ValueError(
                        f"scan_layers: {kind} {name!r} of layer {i} is on {cur[name].device}, "
                        f"layer 0's on {t.device}"
                    )


def _one_layer_fn(first, partition_fn, pure):
    key = (id(first), partition_fn)
    if pure and key in _one_layer_fns:
        return _one_layer_fns[key][1]

    def one_layer(carry, weights):
        args = carry if isinstance(carry, tuple) else (carry,)
        return torch.func.functional_call(first, weights, args, strict=True), None

    if pure:
        _one_layer_fns[key] = (first, one_layer)  # the layer kept alive: its id stays its own
    return one_layer
