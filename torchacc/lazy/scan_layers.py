"""``scan_layers(layers, input_data)``: a stack of identical layers as one scan (lazy/scan.py);
``ScannedLayers``: the same with the weights stored stacked.

The layers' parameters and buffers are stacked along a new leading dimension (``torch.stack``, so
each layer's own parameters get their gradients back through it) and the first layer runs as the
scanned function with each layer's slice put in place by ``torch.func.functional_call``. Layers
must agree in type, parameter and buffer names and shapes: a ``ValueError`` names the layer and
the two shapes otherwise, before anything is recorded. Buffers are read, not written, by the
scanned layer (a running-statistics update inside ``fn`` is not supported).

``scan_layers`` stacks the weights on every call (a copy each step, and every layer's weights
stay separate parameters for the optimizer, whose update then still grows with depth).
``ScannedLayers(layers)`` is a module that holds one ``(depth, ...)`` parameter per weight name
instead: nothing is stacked per step, and the optimizer sees as many parameters at depth 48 as at
depth 4, so the whole training step's compile stays flat in depth.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.scan import scan
from torchacc.lazy.scan_capture import captured

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


class ScannedLayers(nn.Module):
    """Identical ``layers`` as one module with stacked weights, run as one scan on torchacc.

    Each parameter (buffer) ``name`` of the layers becomes one parameter (buffer) of shape
    ``(depth, *shape)``, registered as ``name`` with dots as ``__``; the values are the layers'
    own. ``forward(*args)`` runs layer ``i`` with the ``i``-th slices on the output of layer
    ``i - 1`` (``args`` is the first layer's input; a layer returning a tuple passes it on as the
    next one's arguments): one ``scan`` on torchacc tensors, the same plain loop elsewhere."""

    def __init__(self, layers):
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("ScannedLayers: no layers given")
        params = [dict(layer.named_parameters()) for layer in layers]
        buffers = [dict(layer.named_buffers()) for layer in layers]
        _check_same_structure(layers, params, buffers)
        self.depth = len(layers)
        self._names = list(params[0])
        self._buffer_names = list(buffers[0])
        for name in self._names:
            stacked = torch.stack([p[name].detach() for p in params])
            grad = params[0][name].requires_grad
            self.register_parameter(_key(name), nn.Parameter(stacked, requires_grad=grad))
        for name in self._buffer_names:
            self.register_buffer(_key(name), torch.stack([b[name] for b in buffers]))
        # the structure to run, not registered (its own tensors are never read: meta)
        self._template = (copy.deepcopy(layers[0]).to("meta"),)
        self._fn = _stacked_layer_fn(self._template)

    def weights(self):
        """(parameters, buffers) by the layers' own names, stacked."""
        return (
            {n: getattr(self, _key(n)) for n in self._names},
            {n: getattr(self, _key(n)) for n in self._buffer_names},
        )

    def forward(self, *args):
        self._template[0].train(self.training)
        carry = args[0] if len(args) == 1 else args
        weights = self.weights()
        if captured():  # one scan (Note [Scan on the trace-once frontend]); traced once
            return scan(_stacked_layer_fn(self._template), carry, weights)[0]
        if self._fn.template is not self._template:  # a copy of the module: its own function
            self._fn = _stacked_layer_fn(self._template)
        leaves = [*args, *weights[0].values()]
        if any(t.device.type == DEVICE_TYPE for t in leaves if isinstance(t, torch.Tensor)):
            return scan(self._fn, carry, weights, is_fn_pure=True)[0]
        for i in range(self.depth):
            carry = self._fn(carry, _slice(weights, i))[0]
        return carry


def _key(name):
    return name.replace(".", "__")


def _slice(weights, i):
    return tuple({n: t[i] for n, t in part.items()} for part in weights)


def _stacked_layer_fn(template):
    def one_layer(carry, weights):
        args = carry if isinstance(carry, tuple) else (carry,)
        merged = {**weights[0], **weights[1]}
        return torch.func.functional_call(template[0], merged, args, strict=True), None

    one_layer.template = template
    return one_layer
