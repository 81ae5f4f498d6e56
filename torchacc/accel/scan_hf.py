"""The old import path of ``scan_hf_layers`` (``torchacc.scan_hf_layers``), which is the lazy
frontend's: torchacc/lazy/scan_hf.py (Note [Scanned HF decoder layers])."""

from torchacc.lazy.scan_hf import ScannedDecoderLayers, scan_hf_layers

__all__ = ["ScannedDecoderLayers", "scan_hf_layers"]
