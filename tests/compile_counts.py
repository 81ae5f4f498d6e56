"""How many programs torchacc built: the one count every "no recompile" assertion uses.

A program is built when the in-memory cache misses. JAX then either compiles it
(``UncachedCompile``) or loads it from the persistent compilation cache (``PersistentCacheHit``;
the test suite keeps one in ``.pytest_cache/torchacc``). Counting only ``UncachedCompile`` would let
a cache key that changes every step pass as soon as an earlier run had filled the disk cache, so
both count as a new graph here.
"""

from __future__ import annotations

from torchacc import metrics


def new_graphs():
    """Programs built (compiled or loaded from disk) since the last ``metrics.clear_all()``."""
    return (metrics.counter_value("UncachedCompile") or 0) + (
        metrics.counter_value("PersistentCacheHit") or 0
    )
