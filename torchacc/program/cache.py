"""Compiled programs: the in-memory cache by structural key, and JAX's persistent cache on disk.

Note [What a compiled step is keyed on] is in key.py.
"""

from __future__ import annotations

import ctypes
import os
import time

import jax
import numpy as np

from torchacc import metrics
from torchacc.lowering import precision
from torchacc.program import known
from torchacc.program.build import piece_offsets, program_of
from torchacc.runtime.processes import env_flag
from torchacc.sharding import layout as sharding
from torchacc.sharding import manual  # Note [Multi-process programs]

_cache: dict = {}
_persistent_hits = [0]
memory_hits = [0]  # executables reused from the in-memory cache (never reset by metrics)
on_miss = [None]  # fn(graph, key, cached keys) called before a compile (torchacc/engine/explain.py)


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _persistent_hits[0] += 1


def enable_persistent_cache(path=None):
    """Keep compiled programs under ``path`` (TORCHACC_CACHE_DIR, default ~/.cache/torchacc)."""
    path = (
        path
        or os.environ.get("TORCHACC_CACHE_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "torchacc")
    )
    if path.lower() in ("0", "off", "none"):
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


jax.monitoring.register_event_listener(_on_event)


def compiled_for(graph, args, shardings=None):
    """The executable for ``graph`` (compiling it on a cache miss); ``shardings``: the
    program's ``sharding.plan`` in SPMD mode (sharding/layout.py), else None."""
    key = graph.key + (precision.key(),)  # Note [float32 precision follows torch]
    if shardings is not None:
        key += shardings
    exe = _cache.get(key)
    if exe is not None:
        count_memory_hit()
        return exe
    if on_miss[0] is not None:  # why this compile (Note [Explaining syncs and compiles])
        on_miss[0](graph, key, _cache)
    start = time.perf_counter()
    hits = _persistent_hits[0]
    donate = tuple(2 + i for i in graph.donate)
    with precision.scope():
        if shardings is not None:  # Note [SPMD mode] in sharding/mesh.py
            ins, outs, in_pads, out_pads = shardings
            program = sharding.unpadded(program_of(graph), graph, in_pads, out_pads)
            collective = manual.is_collective_graph(graph)
            if collective:  # per-process code: Note [One mesh]
                program = manual.per_process_region(program, ins, len(outs))
                n = manual.begin_collective_compile()
            fn = jax.jit(program, donate_argnums=donate, in_shardings=ins, out_shardings=list(outs))
            exe = fn.lower(*args).compile()
            if collective:  # Note [Aligning collective programs]
                manual._align_after_compile(n, manual.fingerprint(graph))
        elif manual.is_collective_graph(graph):  # Note [Multi-process programs]
            exe = manual.compile_manual(program_of(graph), args, donate, graph)
        else:  # Note [Pieces read at offset arguments] in build.py
            offsets = [_offset(o) for o in piece_offsets(graph)] if _OFFSET_ARGS else []
            fn = jax.jit(program_of(graph, offsets=bool(offsets)), donate_argnums=donate)
            exe = fn.lower(*args, *offsets).compile()
            if offsets:
                exe = _WithOffsets(exe, offsets)
    seconds = time.perf_counter() - start
    metrics.record_time("CompileTime", seconds)
    if graph.donate:
        metrics.record_value("InputOutputAliasCount", len(graph.donate))
    loaded = _persistent_hits[0] > hits
    metrics.counter_inc("PersistentCacheHit" if loaded else "UncachedCompile")
    metrics.program_compiled(exe)  # its FLOPs (Note [Step FLOPs] in metrics.py)
    _cache[key] = exe
    if not loaded and seconds >= TRIM_AFTER_COMPILE_S:  # Note [Giving a compile's memory back]
        release_freed_memory()
    return exe


# Note [Giving a compile's memory back]
# XLA's compile allocates and frees hundreds of MB of small blocks (HLO passes, LLVM) on its
# threads; glibc keeps what they free in its arenas, where the step's own buffers (XLA:CPU takes
# its temp memory in one large mapping) do not reuse it. So a process that compiled GPT-2 124M's
# step peaked ~0.6 GiB higher at every later step than one that loaded it from the persistent
# cache. After a compile of at least ``TRIM_AFTER_COMPILE_S`` that missed the persistent cache,
# ``malloc_trim`` hands the free pages back to the OS. It only releases memory that nothing uses,
# but it walks every arena of the heap: ~0.1 s of CPU in a test process that had compiled a few
# dozen small programs, which is more than a small program's whole compile. A small compile frees
# little, so only long ones trim (a test file of 300 tiny programs spent 13% of its CPU trimming
# before). Off where the C library has no ``malloc_trim`` (not glibc) or with
# TORCHACC_MALLOC_TRIM=0.
TRIM_AFTER_COMPILE_S = 1.0
_malloc_trim = []


def release_freed_memory():
    """Return the C heap's free pages to the OS (Note [Giving a compile's memory back])."""
    if not _malloc_trim:
        fn = None
        if env_flag("TORCHACC_MALLOC_TRIM"):
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _malloc_trim.append(fn)
    if _malloc_trim[0] is not None:
        _malloc_trim[0](0)


_offsets: dict = {}
# TORCHACC_PIECE_OFFSETS=0: pieces read at static offsets (no offset arguments: ~0.5 us less per
# launch and argument, more distinct kernels to compile)
_OFFSET_ARGS = env_flag("TORCHACC_PIECE_OFFSETS")


def _offset(o):
    """A device int32 scalar ``o``, made once (Note [Pieces read at offset arguments])."""
    a = _offsets.get(o)
    if a is None:
        a = _offsets[o] = jax.device_put(np.int32(o))
    return a


class _WithOffsets:
    """An executable whose trailing arguments are its pieces' offsets, passed on every call."""

    __slots__ = ("exe", "offsets", "__weakref__")

    def __init__(self, exe, offsets):
        self.exe, self.offsets = exe, offsets

    def __call__(self, *args):
        return self.exe(*args, *self.offsets)

    def __getattr__(self, name):  # memory_analysis(), cost_analysis(), as_text(), ...
        return getattr(self.exe, name)


def count_memory_hit():
    """Count a step that reused an in-memory executable (the full path's or a known step's)."""
    metrics.counter_inc("CachedCompile")
    memory_hits[0] += 1


def clear_memory_cache():
    """Forget the in-memory executables (a setting they baked in changed)."""
    _cache.clear()
    known.forget()


def cache_size():
    """Number of executables in the in-memory cache."""
    return len(_cache)
