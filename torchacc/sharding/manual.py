"""Programs as manual regions (program stage of the one engine): a graph holding a collective runs
as one program, ``jax.shard_map`` over the process axis of the job-wide mesh.

See Note [Multi-process programs] in ``torchacc/distributed/__init__.py`` and Note [One mesh] in
``torchacc/sharding/__init__.py``.
"""

from __future__ import annotations

import jax
import numpy as np

from torchacc.runtime.device import jax_device
from torchacc.runtime.processes import _jax_distributed_client, env_int
from torchacc.sharding import mesh as job


def mesh():
    """The process mesh (``sharding.mesh.process_mesh``): one device per process."""
    return job.process_mesh()


def is_collective_graph(graph):
    """True when ``graph`` (a program.Graph) holds a collective and must run as one program over
    the process axis."""
    for node in graph.order:
        if getattr(node.op.rule.fn, "torchacc_collective", False):
            return True
    return False


def compile_manual(program, args, donate):
    """Compile ``program`` (local arrays -> list of local arrays) as one manual region over the
    process axis.

    ``args`` are example arguments (local arrays / numpy) and ``donate`` the donated positions, as
    for ``jax.jit``. Returns a ``ManualExecutable``.
    """
    from jax.sharding import PartitionSpec

    m = mesh()
    rep = job.process_replicated()
    region = jax.shard_map(
        program, mesh=m, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False
    )
    avals = [jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=rep) for a in args]
    exe = jax.jit(region, donate_argnums=donate).lower(*avals).compile()
    _align_after_compile()
    return ManualExecutable(exe, rep)


_compiles = [0]


def _align_after_compile():
    """Wait for every rank to finish compiling before the first run of a new collective program.

    Compile times differ between ranks (a loaded host, a cold cache), while the gloo/NCCL
    transport gives the first collective only ~30 s to find its peers; a barrier on the
    coordination service (generous timeout, TORCHACC_COMPILE_BARRIER_TIMEOUT seconds) lines
    the ranks up first.
    """
    client = _jax_distributed_client()
    if client is None:
        return
    _compiles[0] += 1
    timeout_s = env_int("TORCHACC_COMPILE_BARRIER_TIMEOUT", 1800)
    client.wait_at_barrier(f"torchacc/compiled/{_compiles[0]}", timeout_s * 1000)


try:  # the direct constructor is ~5x cheaper than make_array_from_single_device_arrays
    from jax._src.array import ArrayImpl as _ArrayImpl
except Exception:  # pragma: no cover - private API moved
    _ArrayImpl = None


class ManualExecutable:
    """A compiled manual-region step called like a single-device one: local arrays in, local
    arrays out."""

    __slots__ = ("compiled", "sharding", "device")

    def __init__(self, compiled, sharding):
        self.compiled = compiled
        self.sharding = sharding
        self.device = jax_device()

    def to_global(self, a):
        """The global (replicated-by-declaration) array whose local shard is ``a``."""
        if not isinstance(a, jax.Array):
            a = jax.device_put(a, self.device)
        if _ArrayImpl is not None:
            try:
                return _ArrayImpl(a.aval, self.sharding, [a], committed=True, _skip_checks=True)
            except Exception:
                pass
        return jax.make_array_from_single_device_arrays(a.shape, self.sharding, [a])

    def __call__(self, *args):
        outs = self.compiled(*[self.to_global(a) for a in args])
        return [o.addressable_data(0) for o in outs]
