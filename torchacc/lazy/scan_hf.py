"""``scan_hf_layers(model)``: a HuggingFace transformers model's decoder layers as one scan.

Note [Scanned HF decoder layers]
A transformers decoder (LLaMA, Qwen2, Mistral, GPT-2, ...) runs its layers in a Python loop in its
own ``forward``: ``for layer in self.layers[: config.num_hidden_layers]: hidden = layer(hidden,
attention_mask=..., position_embeddings=..., ...)``. ``scan_hf_layers`` replaces that list
(``model.model.layers``, ``model.transformer.h``) by one ``ScannedDecoderLayers``: the layers'
weights stacked (``ScannedLayers``: one ``(depth, ...)`` parameter per weight name, so the
optimizer's update does not grow with depth either), which the loop sees as a one-element list;
calling it runs every layer as one ``scan`` (one ``lax.scan`` on the lazy torchacc device and,
through torch's scan operator, under ``torch.compile``/``compile_step``; the plain loop in eager
PyTorch). The keyword arguments HF passes every layer (attention mask, rotary
``position_embeddings``, ``position_ids``, ``cache_position``) are the same for all layers: on the
lazy device their tensors ride along the scan's carry unchanged (loop-invariant, never stacked);
under torch.compile/compile_step they are the loop-invariant inputs of torch's scan operator
(``captured_scan``; the operator cannot differentiate a carry of integer or bool tensors). The other
values (``None``, flags) are constants of the traced layer; new ones trace the layer once more.
Training only: a KV cache is refused (the helper sets ``config.use_cache = False``), and so are
layers of different attention types (``config.layer_types``) or structure. ``state_dict()`` keeps
transformers' per-layer names (``layers.3.mlp.up_proj.weight``, copies of the stacked slices) and
``load_state_dict`` accepts them, so ``save_pretrained``/``from_pretrained`` checkpoints and the
``Trainer``'s stay interchangeable with the unwrapped model. Build the optimizer after wrapping.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchacc.lazy.scan import scan
from torchacc.lazy.scan_capture import captured, captured_scan
from torchacc.lazy.scan_layers import ScannedLayers, _key

_STATIC = (type(None), bool, int, float, str, torch.dtype, torch.device)
_TENSOR = object()  # marks an argument slot that a carried tensor fills


def scan_hf_layers(model):
    """Make ``model`` (a transformers model) run its decoder layers as one scan; returns it.

    Note [Scanned HF decoder layers]. Create the optimizer afterwards (the layers' parameters
    are replaced by stacked ones)."""
    owner, name = _find_layers(model)
    layers = list(getattr(owner, name))
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None)
    if types:
        for i, t in enumerate(types[: len(layers)]):
            if t != types[0]:
                raise ValueError(
                    f"scan_hf_layers: layer {i} is a {t!r} layer, layer 0 a {types[0]!r} one "
                    "(config.layer_types); only layers of one kind can be scanned"
                )
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache cannot be carried through a scan (training only)
    setattr(owner, name, ScannedDecoderLayers(layers))
    return model


def _find_layers(model):
    base = getattr(model, "base_model", model)
    for owner in (base, model):
        for name in ("layers", "h"):
            layers = getattr(owner, name, None)
            if isinstance(layers, ScannedDecoderLayers):
                raise ValueError(f"scan_hf_layers: {type(model).__name__} is scanned already")
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return owner, name
    raise ValueError(
        f"scan_hf_layers: found no decoder layer list in {type(model).__name__} (looked for "
        "model.model.layers and model.transformer.h, as transformers' decoders have them)"
    )


class ScannedDecoderLayers(ScannedLayers):
    """Transformers' decoder layers, stacked, standing in for their ``nn.ModuleList``: the model's
    loop sees one element (this module), which runs all layers as one scan."""

    def __init__(self, layers):
        super().__init__(layers)
        self._fns = {}  # (argument structure, constants) -> the scanned function
        self._register_state_dict_hook(_per_layer_state)
        self.register_load_state_dict_pre_hook(_stack_state)

    def __len__(self):
        return self.depth

    def __iter__(self):
        return iter((self,))

    def __getitem__(self, index):
        if isinstance(index, slice) and index.indices(self.depth) == (0, self.depth, 1):
            return (self,)
        raise IndexError(
            f"scan_hf_layers: the {self.depth} decoder layers are one scanned module; they run "
            f"all together, not as layers[{index}] (their weights: .weights(), stacked)"
        )

    def forward(self, hidden_states, *args, **kwargs):
        self._template[0].train(self.training)
        flat, spec = tree_flatten((args, kwargs))
        for v in flat:
            if not isinstance(v, (torch.Tensor, *_STATIC)):
                raise ValueError(
                    f"scan_hf_layers: the decoder layers got a {type(v).__name__} (a KV cache?); "
                    "scanned layers are for training: call the model with use_cache=False"
                )
        tensors = tuple(v for v in flat if isinstance(v, torch.Tensor))
        consts = tuple(_TENSOR if isinstance(v, torch.Tensor) else v for v in flat)
        if captured():  # the tensors enter torch's scan operator as loop-invariant inputs
            fn = _layer_fn(self._template, spec, consts, fixed=True)
            return captured_scan(fn, (hidden_states, ()), self.weights(), tensors)[0][0]
        key = (spec, consts)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = _layer_fn(self._template, spec, consts)
        carry = (hidden_states, tensors)
        return scan(fn, carry, self.weights(), is_fn_pure=True)[0][0]


def _layer_fn(template, spec, consts, fixed=False):
    """One layer on ``(hidden, fixed tensors)`` with the ``i``-th weights; the fixed tensors pass
    through unchanged, or arrive as ``fn``'s third argument (Note [Scanned HF decoder layers])."""

    def one_layer(carry, weights, extra=None):
        hidden, tensors = carry
        it = iter(extra if fixed else tensors)
        args, kwargs = tree_unflatten([next(it) if c is _TENSOR else c for c in consts], spec)
        merged = {**weights[0], **weights[1]}
        out = torch.func.functional_call(template[0], merged, (hidden, *args), kwargs, strict=True)
        if isinstance(out, (tuple, list)):  # older transformers: (hidden, ...)
            out = out[0]
        return (out, tensors), None

    return one_layer


def _per_layer_state(module, state, prefix, _local_metadata):
    """state_dict hook: the stacked entries as transformers' per-layer ones."""
    for part in (module._names, module._buffer_names):
        for name in part:
            stacked = state.pop(prefix + _key(name), None)
            if stacked is None:
                continue
            for i in range(module.depth):
                state[f"{prefix}{i}.{name}"] = stacked[i].clone()
    return state


def _stack_state(module, state, prefix, *_):
    """load_state_dict pre-hook: transformers' per-layer entries stacked again."""
    for name in (*module._names, *module._buffer_names):
        keys = [f"{prefix}{i}.{name}" for i in range(module.depth)]
        if all(k in state for k in keys):
            state[prefix + _key(name)] = torch.stack([state.pop(k) for k in keys])
