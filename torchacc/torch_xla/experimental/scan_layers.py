"""``torch_xla.experimental.scan_layers`` on torchacc: torchacc/lazy/scan_layers.py's, and
torchacc's ``ScannedLayers`` (the layers' weights stored stacked)."""

from __future__ import annotations

from torchacc.lazy.scan_layers import ScannedLayers
from torchacc.lazy.scan_layers import scan_layers as _scan_layers
from torchacc.torch_xla._api import differs


@differs("buffers are read-only inside the scanned layer; as scan for random ops and closures")
def scan_layers(layers, input_data, partition_fn=None, is_layer_pure=False):
    """torch_xla's ``scan_layers``: the layers as one scan over their stacked weights."""
    return _scan_layers(layers, input_data, partition_fn=partition_fn, is_layer_pure=is_layer_pure)


__all__ = ["scan_layers", "ScannedLayers"]  # ScannedLayers: torchacc's own (stacked weights)
