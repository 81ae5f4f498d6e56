"""Stage: pending graph -> structural key -> one jitted JAX program, cached in memory and on disk.

- ``key``: the nodes a sync needs, in order, their inputs, donations and the structural key;
- ``build``: the pure JAX function that replays the nodes' lowering rules;
- ``pack``: small results come back packed, one flat array per dtype (Note [Packed state]);
- ``known``: a step whose recorded ops match an earlier step's launches without a graph walk;
- ``cache``: compile on a miss (``jax.jit``, or an SPMD program with ``spmd``), in-memory and
  persistent caches, compile metrics.
"""

from torchacc.program.cache import (  # noqa: F401
    cache_size,
    clear_memory_cache,
    compiled_for,
    count_memory_hit,
    enable_persistent_cache,
    memory_hits,
)
from torchacc.program.key import Graph  # noqa: F401
