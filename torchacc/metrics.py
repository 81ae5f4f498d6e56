"""Counters and timings, named like torch_xla's where the idea is the same.

Counters: ``MarkStep``, ``UncachedCompile`` (an XLA compile really ran), ``CachedCompile`` (the
in-memory cache had the step), ``PersistentCacheHit`` (the on-disk cache spared a compile),
``TransferToDevice`` / ``TransferFromDevice`` (host<->device copies) and ``aten::<op>`` (an op ran
eagerly on CPU because it has no lowering: a fallback), ``ReadSync`` (a read of a pending tensor --
``.item()``, ``print``, ``.cpu()``, ``bool()`` -- ran the graph it needs: a sync of its own),
``xla::<op>`` (nodes recorded for ``<op>``, torch_xla's per-op IR counters: counted on the recorded
op's cached entry and read through a counter source, torchacc/lazy/op_counters.py).
Timings (seconds): ``TraceTime`` (host time spent recording a step: from the end of the previous
sync to the start of this one), ``CompileTime``, ``ExecuteTime`` (launching the program; execution
itself is asynchronous), ``TransferToDeviceTime``, ``TransferFromDeviceTime``, ``SyncTime``,
``CostAnalysisTime`` (reading a new program's FLOPs, once per compile).
Step FLOPs: ``executed_flops()``, ``last_program_flops()``, ``program_flops(exe)`` (Note [Step
FLOPs]).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections import defaultdict

_counters: dict = defaultdict(int)
_timings: dict = defaultdict(list)
_stamps: dict = defaultdict(list)  # wall-clock time (time.time()) of each timing sample
# Note [Explaining syncs and compiles]: what caused each sync and compile, filled by
# torchacc/engine/explain.py at syncs and compiles only (never per recorded op)
_sync_sites: dict = defaultdict(int)  # (event, kind, file, line) -> count
_compiles: list = []  # one line per compile, why it happened (the first MAX_EXPLAINED kept)
MAX_EXPLAINED = 200


# counters kept elsewhere and read on demand: prefix -> (fn() -> {name: value}, clear fn)
_sources: dict = {}


def add_counter_source(prefix, values, clear):
    """Report the counters ``values()`` returns (names starting with ``prefix``) as counters;
    ``clear()`` resets them with the rest."""
    _sources[prefix] = (values, clear)


def _all_counters():
    out = dict(_counters)
    for values, _clear in _sources.values():
        for k, v in values().items():
            if v:
                out[k] = out.get(k, 0) + v
    return out


def counter_inc(name, n=1):
    _counters[name] += n


def counter_value(name):
    """Value of a counter, or None if it never fired (torch_xla's convention)."""
    for prefix, (values, _clear) in _sources.items():
        if name.startswith(prefix):
            return (values().get(name, 0) + _counters.get(name, 0)) or None
    return _counters.get(name)


def counter_names():
    if not _sources:
        return sorted(_counters)
    return sorted(_all_counters())


def record_time(name, seconds):
    _timings[name].append(seconds)
    _stamps[name].append(time.time())


# metrics whose samples are amounts, not seconds (torch_xla's byte and count metrics):
# ``OutboundData`` (bytes an upload sent), ``InputOutputAliasCount`` (donated inputs a new
# program's results reuse, once per compile)
VALUE_METRICS = frozenset({"OutboundData", "InputOutputAliasCount"})


def record_value(name, value):
    """One sample of a ``VALUE_METRICS`` metric."""
    record_time(name, value)


@contextlib.contextmanager
def timed(name):
    start = time.perf_counter()
    try:
        yield
    finally:
        record_time(name, time.perf_counter() - start)


def metric_names():
    return sorted(_timings)


def metric_data(name):
    """(number of samples, total seconds, list of samples) or None, like torch_xla's metric_data."""
    samples = _timings.get(name)
    if not samples:
        return None
    return len(samples), sum(samples), list(samples)


def metric_samples(name):
    """``[(wall-clock time, seconds), ...]`` of a timing (empty if it never fired)."""
    return list(zip(_stamps.get(name, ()), _timings.get(name, ())))


# Note [Step FLOPs]
# MFU while a job runs needs the FLOPs the device executed, at no cost per step. XLA's cost
# analysis of a compiled program gives its FLOPs (per device: an SPMD program is the partitioned
# per-device module). The compile paths (program/cache.py for the lazy frontend, dynamo/lower.py
# and dynamo/flat.py for the trace-once one) read it once per compile, with
# ``program_compiled(exe)``, into ``_program_flops`` keyed by the executable's id (the
# entry leaves with the executable). Every launch then adds its program's FLOPs to a running total
# with ``program_ran(exe)``: one dict lookup and an add, no device sync, no extra compile. A reader
# (the launcher's log, ``ta.accelerate``'s, benchmarks/) takes ``executed_flops()`` at two moments
# and divides the difference by the wall time between them: achieved FLOP/s per device, for the
# same window its samples/s covers. ``clear_counters`` resets the total, not the programs' FLOPs.
# FLOPs are XLA's count of the optimized program: rematerialized (gradient checkpointing) work is
# counted, and a fused op is counted by its arithmetic.
_program_flops: dict = {}  # id(executable) -> FLOPs of one launch (per device)
_flops = [0.0, 0.0]  # [FLOPs executed since clear_counters, FLOPs of the last launched program]


def program_compiled(exe, flops=None):
    """Remember the FLOPs per device of one launch of the newly compiled ``exe``: ``flops``, or
    else its ``cost_analysis()`` (XLA's; read once per compile, timed as ``CostAnalysisTime``).
    Unknown (no cost analysis on this backend, no ``flops`` entry) leaves it unrecorded."""
    if flops is None:
        start = time.perf_counter()
        flops = _cost_analysis_flops(exe)
        record_time("CostAnalysisTime", time.perf_counter() - start)
    if flops is None:
        return
    key = id(exe)
    _program_flops[key] = float(flops)
    try:
        weakref.finalize(exe, _program_flops.pop, key, None)
    except TypeError:  # not weak-referenceable: the entry stays (the program's caches keep it)
        pass


def _cost_analysis_flops(exe):
    try:
        costs = exe.cost_analysis()
    except Exception:  # noqa: BLE001 - a missing number, never a failed compile
        return None
    if isinstance(costs, (list, tuple)):  # older JAX: one dict per partition
        costs = costs[0] if costs else None
    flops = costs.get("flops") if isinstance(costs, dict) else None
    return float(flops) if isinstance(flops, (int, float)) and flops > 0 else None


def program_ran(exe):
    """Count one launch of ``exe`` (Note [Step FLOPs]); the hot path: one dict lookup."""
    f = _program_flops.get(id(exe))
    if f is not None:
        _flops[0] += f
        _flops[1] = f


def program_flops(exe):
    """FLOPs per device of one launch of the compiled ``exe``, or None if unknown."""
    return _program_flops.get(id(exe))


def executed_flops():
    """FLOPs per device of every program launched since ``clear_counters`` (launched: queued;
    the device may still be running the last ones)."""
    return _flops[0]


def last_program_flops():
    """FLOPs per device of the last launched program (a training step's, in a loop), or None."""
    return _flops[1] or None


class FlopsWindow:
    """Achieved FLOP/s per device between log lines (Note [Step FLOPs]): ``take`` reads
    ``executed_flops()`` (a float, no sync) and reports the window since the previous ``take``."""

    def __init__(self):
        self._mark = executed_flops()

    def take(self, steps: int, seconds_per_step: float, peak_flops: float | None = None):
        """``{"step_flops", "tflops", "mfu"}`` for the ``steps`` steps since the last call, run at
        ``seconds_per_step`` each (the log line's step time); None when no program with known
        FLOPs ran (an eager run, a backend without cost analysis)."""
        now = executed_flops()
        delta, self._mark = now - self._mark, now
        if delta <= 0 or steps <= 0 or not seconds_per_step or seconds_per_step <= 0:
            return None
        per_step = delta / steps
        achieved = per_step / seconds_per_step
        return {
            "step_flops": per_step,
            "tflops": achieved / 1e12,
            "mfu": achieved / peak_flops if peak_flops else None,
        }


def executed_fallback_ops():
    return sorted(name for name in _counters if name.startswith("aten::"))


def clear_all():
    clear_counters()
    clear_metrics()


def clear_metrics():
    """Forget the timings (counters stay)."""
    _timings.clear()
    _stamps.clear()


def clear_counters():
    _counters.clear()
    for _values, clear in _sources.values():
        clear()
    _sync_sites.clear()
    _compiles.clear()
    _flops[0] = _flops[1] = 0.0


def _fmt_seconds(s):
    if s < 1e-3:
        return f"{s * 1e6:.1f}us"
    if s < 1:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.3f}s"


def _fmt_amount(v):
    return f"{v:g}"


def metrics_report():
    """Readable text: every timing (count, total, mean, p50) then every counter."""
    lines = []
    for name in metric_names():
        samples = sorted(_timings[name])
        total = sum(samples)
        fmt = _fmt_amount if name in VALUE_METRICS else _fmt_seconds
        lines.append(f"Metric: {name}")
        lines.append(f"  TotalSamples: {len(samples)}")
        lines.append(f"  Accumulator: {fmt(total)}")
        lines.append(f"  Mean: {fmt(total / len(samples))}")
        lines.append(
            f"  Percentiles: 50%={fmt(samples[len(samples) // 2])}; max={fmt(samples[-1])}"
        )
    counters = _all_counters()
    for name in sorted(counters):
        lines.append(f"Counter: {name}")
        lines.append(f"  Value: {counters[name]}")
    return "\n".join(lines) + "\n"


def short_metrics_report(counter_names_=None, metric_names_=None):
    names = counter_names_ or [
        "MarkStep",
        "UncachedCompile",
        "CachedCompile",
        "PersistentCacheHit",
        "TransferFromDevice",
        "ReadSync",
    ]
    mnames = metric_names_ or ["CompileTime", "ExecuteTime", "TraceTime"]
    lines = []
    for name in mnames:
        data = metric_data(name)
        if data:
            lines.append(f"Metric: {name}: count={data[0]} total={_fmt_seconds(data[1])}")
    for name in names:
        if name in _counters:
            lines.append(f"Counter: {name}: {_counters[name]}")
    if counter_names_ is None:  # like torch_xla's: every op that fell back to the CPU
        for name in executed_fallback_ops():
            lines.append(f"Counter: {name}: {_counters[name]}")
    return "\n".join(lines) + "\n"


# --- why syncs and compiles happened (Note [Explaining syncs and compiles]) ---------------------


def sync_site_inc(event, kind, file, line):
    """Count a sync: ``event`` ``mark_step`` or ``read``, what read (``kind``: ``print(loss)``,
    ``.item()``...) and the user's line (``file``, ``line``)."""
    _sync_sites[(event, kind, file, line)] += 1


_short: dict = {}  # (path, working directory) -> short path


def short_path(path):
    """``path`` relative to the working directory when it is under it, an installed package's
    file from its package (``torch/nn/utils/clip_grad.py``), else as it is."""
    cwd = os.getcwd()
    short = _short.get((path, cwd))
    if short is None:
        try:
            rel = os.path.relpath(path, cwd)
        except ValueError:
            rel = ".."
        if rel.startswith(".."):
            installed = path.split(os.sep + "site-packages" + os.sep, 1)
            rel = installed[1] if len(installed) == 2 else path
        short = _short[(path, cwd)] = rel
    return short


def compile_explained(text):
    """Keep why a compile happened (``text``: its trigger and the difference from the cache)."""
    if len(_compiles) < MAX_EXPLAINED:
        _compiles.append(text)


def sync_sites():
    """``[((event, kind, "file:line"), count), ...]``, the most frequent first."""
    out = {}
    for (event, kind, file, line), n in _sync_sites.items():
        key = (event, kind, f"{short_path(file)}:{line}")
        out[key] = out.get(key, 0) + n
    return sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))


def compile_explanations():
    """Why each compile happened, in order (the first ``MAX_EXPLAINED``)."""
    return list(_compiles)


def explain_summary(top=5):
    """The counts of :func:`explain_report` as a dict (the trainer's ``--output`` JSON keeps it)."""
    compiled = _counters.get("UncachedCompile", 0)
    loaded = _counters.get("PersistentCacheHit", 0)
    marks = _counters.get("MarkStep", 0)
    reads = _counters.get("ReadSync", 0)
    return {
        "compiles": compiled + loaded,
        "compiled": compiled,
        "persistent_cache_hits": loaded,
        "syncs": marks + reads,
        "mark_steps": marks,
        "read_syncs": reads,
        "compile_reasons": compile_explanations(),
        "top_sync_sites": [
            {"event": event, "what": kind, "site": site, "count": n}
            for (event, kind, site), n in sync_sites()[:top]
        ],
    }


def _n(count, noun):
    return f"{count} {noun}{'' if count == 1 else 's'}"


def explain_report(top=5):
    """Compiles and syncs with their causes: counts, each compile's reason, the top sync sites."""
    s = explain_summary(top)
    lines = [
        f"torchacc: {_n(s['compiles'], 'compile')} ({s['compiled']} compiled, "
        f"{s['persistent_cache_hits']} from the persistent cache), {_n(s['syncs'], 'sync')} "
        f"({s['mark_steps']} mark_step, {_n(s['read_syncs'], 'read')} of a pending tensor)"
    ]
    explained = s["compile_reasons"]
    if len(explained) > 2 * top:
        hidden = s["compiles"] - 2 * top
        explained = explained[:top] + [f"... ({hidden} more)"] + explained[-top:]
    lines.extend(f"  compile {text}" for text in explained)
    for site in s["top_sync_sites"]:
        what = "mark_step" if site["event"] == "mark_step" else site["what"]
        lines.append(f"  sync x{site['count']}: {what} at {site['site']}")
    return "\n".join(lines) + "\n"
