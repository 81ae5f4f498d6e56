"""``torch_xla.experimental.custom_kernel``: ``_shard_map``, a manual region on torchacc's one
engine (``torchacc.sharding.regions``). torch_xla's Pallas kernels (``flash_attention`` & co.)
are TPU kernels and are not provided: use ``torchacc.ops`` or SDPA."""

from __future__ import annotations

from torchacc.sharding import regions as _regions


def _shard_map(func, mesh, input_specs, output_specs):
    """``func`` as a manual region over every axis of ``mesh``: it runs on each device's block
    of its arguments (``input_specs``) and its results' blocks form the outputs
    (``output_specs``); ``xm`` collectives inside run over the mesh's axes."""
    return _regions.shard_map(func, mesh, input_specs, output_specs)
