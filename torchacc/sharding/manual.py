"""Programs as manual regions (program stage of the one engine): a graph holding a collective runs
as one program, ``jax.shard_map`` over the process axis of the job-wide mesh.

See Note [Multi-process programs] in ``torchacc/distributed/__init__.py`` and Note [One mesh] in
``torchacc/sharding/__init__.py``.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from torchacc import metrics
from torchacc.runtime import processes
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


def compile_manual(program, args, donate, graph=None):
    """Compile ``program`` (local arrays -> list of local arrays) as one manual region over the
    process axis.

    ``args`` are example arguments (local arrays / numpy) and ``donate`` the donated positions, as
    for ``jax.jit``. Returns a ``ManualExecutable``.
    """
    from jax.sharding import PartitionSpec

    n = begin_collective_compile()
    m = mesh()
    rep = job.process_replicated()
    region = jax.shard_map(
        program, mesh=m, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False
    )
    avals = [jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=rep) for a in args]
    exe = jax.jit(region, donate_argnums=donate).lower(*avals).compile()
    mine = fingerprint(graph) if graph is not None else ",".join(str(a.shape) for a in avals)
    _align_after_compile(n, mine)
    return ManualExecutable(exe, rep)


def per_process_region(program, in_shardings, n_out):
    """SPMD mode: ``program`` (``(floats, ints, *arrays) -> list``) holding a per-process
    collective as a manual region over the process axes of the engine mesh, automatic over the
    others (Note [One mesh]). Every argument and result is declared replicated over the process
    axes, as in ``compile_manual``: each process's devices hold its own values (its replica of the
    model, sharded over its local devices by XLA's partitioner), and the collectives inside run
    over the process axes. An argument split over a process axis is a ValueError."""
    from jax.sharding import PartitionSpec

    from torchacc.sharding import rules

    engine = job.engine_mesh()
    axes = job.process_axes(engine)
    if not axes:  # one process: nothing to reduce across (the helpers record no collective)
        return program
    for k, s in enumerate(in_shardings):
        used = {
            n
            for e in getattr(s, "spec", ())
            if e is not None
            for n in (e if isinstance(e, tuple) else (e,))
        }
        if used & set(axes):
            raise ValueError(
                f"torchacc: a step holding a per-process collective (xm.all_reduce, DDP, Horovod) "
                f"reads argument {k - 2} split over the process axes {axes} of mesh "
                f"{dict(engine.shape)} ({s.spec}); per-process code sees its own process's data: "
                "shard it over the local axes only"
            )

    def body(*xs):
        with rules.lowering_region(axes):
            return list(program(*xs))

    return jax.shard_map(
        body,
        mesh=engine,
        in_specs=PartitionSpec(),
        out_specs=[PartitionSpec()] * n_out,
        axis_names=frozenset(axes),
        check_vma=False,
    )


_pairs: dict = {}  # (source, target, shape, dtype) -> jitted two-process ppermute


def pair_permute(array, source, target):
    """Process ``source``'s ``array`` at process ``target`` (its result there; elsewhere
    ``array``'s own zeros): one ppermute in a program over just those two processes' devices, so
    the job's other processes take no part (torch's blocking ``dist.send``/``recv`` in a job of
    more than two processes). Both processes call it with arrays of one shape and dtype, in the
    same order; it is not a step's collective program (not aligned, not counted there)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = job.job_devices()[:, 0]
    me = devs[processes.rank()]
    if len(getattr(array, "devices", lambda: [me])()) != 1:
        raise NotImplementedError(
            "torchacc: send/recv of a tensor spread over several devices (SPMD mode) in a job of "
            "more than two processes; write the exchange as xm.collective_permute on every rank"
        )
    key = (int(source), int(target), tuple(array.shape), str(array.dtype))
    entry = _pairs.get(key)
    if entry is None:
        m = Mesh(np.array([devs[source], devs[target]]), (job.PROCESS_AXIS,))
        sharding = NamedSharding(m, PartitionSpec())

        def hop(v):
            return jax.lax.ppermute(v, job.PROCESS_AXIS, [(0, 1)])

        region = jax.shard_map(
            hop, mesh=m, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False
        )
        entry = _pairs[key] = (jax.jit(region), sharding)
    fn, sharding = entry
    local = jax.device_put(array, me)
    out = fn(jax.make_array_from_single_device_arrays(local.shape, sharding, [local]))
    return out.addressable_data(0)


# Note [Aligning collective programs]
# Compile times differ between ranks (a loaded host, a cold cache), while the gloo/NCCL transport
# gives the first collective only ~30 s to find its peers, so the ranks line up on the
# coordination service before the first run of each new program holding a collective: rank r
# posts "compiling #n" before it compiles its n-th such program and "compiled #n: <collectives>"
# after, then waits for every other rank's "compiled #n". A rank still compiling is waited for
# (TORCHACC_COMPILE_BARRIER_TIMEOUT s); a rank that has not even started program #n after
# TORCHACC_COLLECTIVE_TIMEOUT s (default 60) skipped a collective the others recorded (say under
# ``if rank == 0``), and a rank whose program #n holds other collectives recorded different ones:
# both are a RuntimeError naming the program, this rank's step and the other rank, not a hang.
# Programs without a collective are this process's own business and are never aligned, so a
# read or a sync on some ranks only (rank-0 logging) never waits for the others.

_compiles = [0]


def begin_collective_compile():
    """Post "compiling #n" (before compiling a program holding a collective); returns n."""
    client = _jax_distributed_client()
    _compiles[0] += 1
    n = _compiles[0]
    if client is not None:
        client.key_value_set(f"torchacc/compiling/{n}/{processes.rank()}", "1")
    return n


def fingerprint(graph):
    """The collectives a graph holds, in order: name, output shapes and static arguments (the
    reduction, groups, pairs: what ranks must agree on)."""
    parts = []
    for node in graph.order:
        if getattr(node.op.rule.fn, "torchacc_collective", False):
            shapes = [None if d is None else tuple(d[0]) for d in node.op.descs]
            statics = [a for a in node.op.args if isinstance(a, str)]  # op, groups, pairs
            parts.append(f"{node.op.rule.name}{shapes}{statics}")
    return ";".join(parts)


def _posted(client, key):
    try:
        client.key_value_try_get(key)
        return True
    except Exception:  # not found
        return False


def _align_after_compile(n, mine=""):
    """Wait until every rank has compiled its collective program ``n`` (Note [Aligning
    collective programs])."""
    client = _jax_distributed_client()
    if client is None:
        return
    me, world = processes.rank(), processes.world_size()
    client.key_value_set(f"torchacc/compiled/{n}/{me}", mine)
    arrive_s = env_int("TORCHACC_COLLECTIVE_TIMEOUT", 60)
    compile_s = env_int("TORCHACC_COMPILE_BARRIER_TIMEOUT", 1800)
    start = time.monotonic()
    step = metrics.counter_value("MarkStep") or 0
    where = f"collective program #{n} (rank {me}'s step {step})"
    for r in range(world):
        if r == me:
            continue
        while True:
            try:
                theirs = client.blocking_key_value_get(f"torchacc/compiled/{n}/{r}", 500)
                break
            except Exception:
                pass
            waited = time.monotonic() - start
            started = waited <= arrive_s or _posted(client, f"torchacc/compiling/{n}/{r}")
            if waited > arrive_s and not started:
                raise RuntimeError(
                    f"torchacc: rank {me} runs {where} holding {mine or 'collectives'}, but rank "
                    f"{r} has not reached it in {arrive_s} s: a collective that rank {r} skipped "
                    "(recorded on some ranks only, e.g. under `if rank == 0`)? Every rank must "
                    "record the same collectives in the same order"
                )
            if waited > compile_s:
                raise RuntimeError(
                    f"torchacc: rank {me} waited {compile_s} s for rank {r} to compile {where}"
                )
        if mine and theirs and theirs != mine:
            raise RuntimeError(
                f"torchacc: rank {me}'s {where} holds {mine}, rank {r}'s holds {theirs}: the "
                "ranks recorded different collectives (a collective skipped on some ranks?)"
            )


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
