"""Running graphs: sync/mark_step, binding results, donation, and host<->device transfers.

``sync()`` compiles (on a cache miss) and launches one program computing every live tensor with
pending work, then returns at once: JAX executes asynchronously, so the host records the next step
while the device runs this one. Reading a value (``.item()``, ``.cpu()``, ``print``) runs just the
graph that value needs and waits for it; that is a counted transfer (``TransferFromDevice``).
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from torchacc import metrics
from torchacc import program as compiler
from torchacc.engine import explain
from torchacc.engine.transfer import Deferred, put, read, upload  # noqa: F401
from torchacc.ir import live_storages
from torchacc.lowering import precision
from torchacc.program import known, pack
from torchacc.runtime import processes
from torchacc.sharding import layout as sharding
from torchacc.sharding import mesh

_last_outputs: list = []
_last_sync_end = [None]


_after_sync: list = []
# torch_xla's ``_XLAC._set_allow_execution``: False makes every program launch an error (a
# compiled region that must not run the device, e.g. while tracing); read once per launch
allow_execution = [True]


def _check_allowed():
    if not allow_execution[0]:
        raise RuntimeError(
            "torchacc: a program was about to run while execution is disallowed "
            "(torch_xla._XLAC._set_allow_execution(False)); something read or synced a pending "
            "tensor inside a region that must not run the device"
        )


def after_sync(fn):
    """Call ``fn()`` after every sync (torch_xla step closures hook in here)."""
    _after_sync.append(fn)
    return fn


def fetch(value, dtype):
    """A CPU tensor with ``value``'s data (running its graph first if it is pending)."""
    if value.node is not None:
        explain.on_read()  # Note [Explaining syncs and compiles]
        run([value], donate=False)
    if type(value) is Deferred:  # still on the host (Note [Deferred uploads])
        host = value.host_data()
        return host.clone() if host.dtype == dtype else host.to(dtype)
    if type(value.buf) is tuple:  # a piece of a pack (Note [Packed state])
        return read(pack.host_piece(value), dtype)
    return read(value.array, dtype)


# called with a sync's pending outputs before its graph runs (say torch_xla's graph dumps,
# XLA_SAVE_TENSORS_FILE); each may return a function to call once the graph ran
_graph_observers: list = []


def observe_graphs(fn):
    """Call ``fn(outputs)`` at every sync that runs a graph, with its pending output Values,
    before it runs; a function ``fn`` returns is called after it ran."""
    _graph_observers.append(fn)


def _live_outputs(clear=True):
    """The pending Values of live storages (a sync's outputs, in storage creation order), the
    ids of every Value and array some live storage holds, and per output the Value its storage
    held when the step began (``Storage.start``; ``clear``: a sync's pass clears it), from one
    pass over the storages."""
    outputs, held, starts = [], set(), []
    add, append = held.add, outputs.append
    for st in live_storages():
        v = st.value
        start = st.start
        if clear:
            st.start = None
        i = id(v)
        if i in held:
            continue
        add(i)
        if v.node is not None:
            append(v)
            starts.append(start)
        else:
            b = v.buf
            if type(b) is tuple:  # a piece: its pack is held (Note [Packed state])
                add(id(b[0]))
            elif b is not None:
                add(id(b))
    return outputs, held, starts


def run(outputs, donate, held=None, learn=False, starts=None):
    """Compute the pending Values ``outputs`` with one program and bind their arrays.

    With ``donate``, inputs no live storage holds give their buffers to the outputs; ``held`` is
    that set of ids when the caller has it already (``_live_outputs``). With ``learn`` (a
    ``mark_step``), the step is remembered as a known step (Note [Known steps]), and small
    results come back packed (Note [Packed state]): ``starts`` (``_live_outputs``) lets the
    step's loose inputs move into packs laid out like its results first."""
    _check_allowed()
    if not learn:
        known.spoil("part of the step ran before mark_step")
    if donate and held is None:
        held = _live_outputs(clear=False)[1]
    plan = None
    if learn and starts is not None:  # a read's results are read at once: they stay loose
        plan = pack.output_plan(outputs, starts, pack.max_numel())
        if plan[1]:
            pack.lay_out_like_results(outputs, starts, plan, held)
    graph = compiler.Graph(outputs, held if donate else None, plan, starts)
    shardings = None
    if mesh.is_spmd():  # Note [SPMD mode] in sharding/mesh.py
        sharding.normalize(graph.loose)
        shardings = sharding.plan(graph, outputs, starts)
    args = _args(graph.floats, graph.ints, graph.args())
    exe = compiler.compiled_for(graph, args, shardings)
    if learn:
        known.learn(graph, exe, held, precision.key())
    _launch(exe, args, outputs, graph, len(graph.order))


def _args(floats, ints, arrays):
    floats = np.asarray(floats, dtype=np.float64)
    ints = np.asarray(ints, dtype=np.int64)
    if mesh.is_spmd() and processes.spans_processes():  # global arrays, not host data
        floats, ints = put(floats), put(ints)
    return [floats, ints, *arrays]


def _launch(exe, args, outputs, plan, n_ops):
    """Run ``exe`` and bind its results; ``plan`` (a Graph or a known step's Launch) has the
    argument packs and loose inputs, the donated positions and the output plan."""
    metrics.counter_inc("RecordedOps", n_ops)
    start = time.perf_counter()
    results = exe(*args)
    seconds = time.perf_counter() - start
    metrics.record_time("ExecuteTime", seconds)
    if mesh.is_spmd():  # torch_xla's names for a program over every device
        metrics.record_time("ExecuteReplicatedTime", seconds)
        metrics.counter_inc("ExecuteReplicated")
    metrics.program_ran(exe)  # Note [Step FLOPs]
    pack.bind(results, outputs, plan.out_codes, plan.out_packs, plan.out_order)
    packs, loose = plan.packs, plan.loose
    n_packs = len(packs)
    for i in plan.donate:  # their buffers now belong to the outputs
        if i < n_packs:
            packs[i].array = None
        else:
            loose[i - n_packs].buf = None
    _last_outputs[:] = results


def _run_known(launch, outputs):
    """Launch a known step's program (Note [Known steps]): no graph walk, no key."""
    _check_allowed()
    compiler.count_memory_hit()
    metrics.counter_inc("KnownStep")
    args = _args(launch.floats, launch.ints, launch.args())
    _launch(launch.exe, args, outputs, launch, launch.n_order)


def sync(wait=False):
    """Compile and launch everything pending (torch_xla's mark_step). Non-blocking by default."""
    now = time.perf_counter()
    if _last_sync_end[0] is not None:
        metrics.record_time("TraceTime", now - _last_sync_end[0])
    metrics.counter_inc("MarkStep")
    outputs, held, starts = _live_outputs()
    explain.on_mark_step(bool(outputs))  # Note [Explaining syncs and compiles]
    if outputs:
        after = [fn(outputs) for fn in _graph_observers] if _graph_observers else ()
        launch = known.match(outputs, held, precision.key(), starts)
        if launch is not None:
            _run_known(launch, outputs)
        else:
            run(outputs, donate=True, held=held, learn=True, starts=starts)
        for fn in after:
            if fn is not None:
                fn()
    known.next_step()
    _gc_after_sync()
    if wait:
        wait_device_ops()
    end = time.perf_counter()
    metrics.record_time("SyncTime", end - now)
    _last_sync_end[0] = end
    for fn in _after_sync:
        fn()


# Note [Garbage collection]
# Tracing a step allocates a few Python objects per op (Nodes, Values, tensors) that live until
# the sync, so they survive young collections and every few steps trigger a full collection. A
# full collection walks every tracked object in the process -- several hundred thousand after
# importing torch and JAX and compiling once -- and took ~50 ms on the CPU box, several times a
# training step's host time. So at the first sync that reuses a compiled step (the training loop is
# running: model, optimizer state and compiled programs exist) torchacc collects once and moves
# everything alive into the collector's permanent generation (``gc.freeze()``). Later collections
# only walk newer objects. A step's graph has no reference cycles (Note [Values, storages and
# views]), so it is freed by reference counting either way. Reference cycles among frozen objects
# that die later (say, a data loader iterator alive at that moment) wait for the next re-freeze:
# every ``GC_REFREEZE_EVERY`` syncs torchacc unfreezes, collects everything once and freezes again,
# one full collection per that many steps. The same sync raises the young-generation threshold
# from Python's 700 allocations to ``GC_YOUNG_THRESHOLD``: a recorded step allocates and frees
# thousands of objects, so at 700 the collector ran ~6 young and ~0.5 middle collections per
# ResNet-50 step, each also calling JAX's XLA garbage callback, ~2 ms of a ~55 ms step on the CPU
# box, to find no cycles; at 10,000 a step runs none. ``TORCHACC_GC_FREEZE=0`` keeps Python's
# default behaviour (no freeze, thresholds untouched).
GC_REFREEZE_EVERY = 1000
GC_YOUNG_THRESHOLD = 10_000
_gc_frozen = [False]
_syncs_since_freeze = [0]


def _gc_after_sync():
    if _gc_frozen[0]:
        _syncs_since_freeze[0] += 1
        if _syncs_since_freeze[0] >= GC_REFREEZE_EVERY:
            _syncs_since_freeze[0] = 0
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        return
    if not compiler.memory_hits[0]:
        return
    if os.environ.get("TORCHACC_GC_FREEZE", "1").strip().lower() in ("0", "", "false", "off"):
        return
    _gc_frozen[0] = True
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < GC_YOUNG_THRESHOLD:  # 0: the user switched automatic collection off
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


def wait_device_ops():
    """Block until every launched program has finished."""
    for a in _last_outputs:
        a.block_until_ready()
