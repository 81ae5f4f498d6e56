"""Why each sync and each compile of the lazy path happened, in the user's words.

Note [Explaining syncs and compiles]
Every sync is counted by its trigger site (Note [Trigger sites] in sites.py): ``mark_step`` at the
user's line, or a read of a pending tensor (``.item()``, ``print``, ``.cpu()``, ``bool()``...) at
the user's line, counted as ``ReadSync``. ``TORCHACC_DEBUG=1`` prints one line per read sync. A
read that splits a step (the read ran a graph, then ``mark_step`` still had work: two graphs where
one would do, the part they share computed twice) gets a one-time ``SyncWarning`` at the read's
line. Every compile records its trigger and what differs from the nearest cached graph, with input
names (Note [Naming graph inputs] in names.py) and ATen op names; with ``TORCHACC_DEBUG=1`` set
before the step was recorded, also the user's line that recorded the differing op
(``torchacc/lazy/op_sites.py``). ``torchacc.metrics.explain_report()`` sums it up.

Cost: a stack walk per sync and per fallback, a name search per compile; nothing per recorded op
unless ``TORCHACC_DEBUG=1``.
"""

from __future__ import annotations

import bisect
import os
import sys

from torchacc import metrics
from torchacc.engine import names, sites
from torchacc.program import cache as compiler
from torchacc.program import known
from torchacc.program import miss as misses


class SyncWarning(UserWarning):
    """A read of a pending tensor split a training step into several graphs."""


def debug():
    return os.environ.get("TORCHACC_DEBUG", "0").strip() not in ("", "0")


_trigger = [None]  # what the running sync is for: a sites.Read, or ("mark_step", Site)
_split_reads: list = []  # reads that ran a graph since the last mark_step (until the hint is shown)
_hinted = [False]
_names_by_key: dict = {}  # compiled key -> its input names (to explain a later input-count miss)


def on_mark_step(pending):
    """A ``mark_step``; ``pending``: it has work to run."""
    frame = sites.user_frame(sites.caller(1))
    if frame is None:
        metrics.sync_site_inc("mark_step", "mark_step", "<unknown>", 0)
        _trigger[0] = ("mark_step", sites.Site("<unknown>", 0, "?"))
    else:
        code, line = frame.f_code, frame.f_lineno
        metrics.sync_site_inc("mark_step", "mark_step", code.co_filename, line)
        _trigger[0] = ("mark_step", code, line)
    if _split_reads:
        if pending and not _hinted[0]:
            _hinted[0] = True
            _hint(_split_reads[0], len(_split_reads) + 1, _mark_site(_trigger[0]))
        _split_reads.clear()
    _op_ranges[0], _op_ranges[1] = _op_ranges[1], []


def on_read():
    """A read of a pending tensor is about to run the graph it needs."""
    read = sites.describe_read(sites.caller(1))
    metrics.counter_inc("ReadSync")
    metrics.sync_site_inc("read", read.what(), read.site.file, read.site.line)
    _trigger[0] = read
    if not _hinted[0]:
        _split_reads.append(read)
    if debug():
        print(f"torchacc: sync: {read.describe()} reads a pending tensor", file=sys.stderr)


def _hint(read, graphs, mark_site):
    sites.warn_at(
        read.site,
        f"torchacc: {read.describe()} read a tensor of a step that was not run yet, so the step "
        f"ran as {graphs} graphs instead of one: the read ran the part it needs, then mark_step "
        f"at {mark_site} ran the rest, computing again what they share. Read it after "
        "mark_step (xm.mark_step() / torchacc.sync()) to keep one graph per step. "
        "(Shown once; TORCHACC_DEBUG=1 prints every sync a read causes.)",
        SyncWarning,
    )


# --- compiles ------------------------------------------------------------------------------------


def on_miss(graph, key, cached):
    """A compile is about to run for ``graph`` (its ``key`` is not among ``cached``)."""
    trigger, _trigger[0] = _trigger[0], None
    number = (metrics.counter_value("UncachedCompile") or 0) + (
        metrics.counter_value("PersistentCacheHit") or 0
    )
    try:
        what = _describe_trigger(trigger)
        reason = _reason(graph, key, cached, sites.caller(1))
    except Exception as e:  # an explanation must never break a training step
        what, reason = "a sync", f"(torchacc could not explain it: {type(e).__name__}: {e})"
    text = f"#{number + 1} for {what} ({len(graph.order)} ops): {reason}"
    metrics.compile_explained(text)
    if debug():
        print(f"torchacc: compiling graph {text}", file=sys.stderr)


def _describe_trigger(trigger):
    if trigger is None:
        return f"a sync at {sites.user_site(sites.caller(2))}"
    if isinstance(trigger, sites.Read):
        return trigger.describe()
    return f"mark_step at {_mark_site(trigger)}"


def _mark_site(trigger):
    if len(trigger) == 2:
        return trigger[1]
    code = trigger[1]
    return sites.Site(code.co_filename, trigger[2], code.co_name)


def _reason(graph, key, cached, frame):
    found = misses.find_miss(key, cached)
    input_names = names.input_names(graph.inputs, frame)
    if len(_names_by_key) < 4096:
        _names_by_key[key] = input_names
    what = found.what
    if what == "first":
        return "the first graph"
    nearest = "the nearest cached graph"
    if what == "new":
        return (
            f"a graph unlike the {found.old} cached ones: it starts with "
            f"{misses.describe_op(found.new)}{_recorded_at(graph, 0)}"
        )
    if what == "input":
        name = input_names[found.index]
        return (
            f"input `{name}` is {misses.describe_aval(*found.new)}; {nearest} had "
            f"{misses.describe_aval(*found.old)}"
        )
    if what == "inputs":
        ops = f"{len(key[1]) // 2} ops vs {len(found.nearest[1]) // 2}"
        changed = _name_diff(input_names, _names_by_key.get(found.nearest))
        return f"{found.new} inputs vs {found.old} in {nearest} ({ops}){changed}"
    if what in ("op", "args"):
        i = found.index
        op = f"{misses.describe_op(found.new)} (op {i}{_recorded_at(graph, i)})"
        if what == "op":
            return f"{op}; {nearest} has {misses.describe_op(found.old)} there"
        diff = misses.first_arg_difference(found.new, found.old)
        if diff is None:
            return f"{op} has other arguments than in {nearest}"
        return f"{op} has argument {diff[1]} where {nearest} had {diff[2]}"
    if what == "ops":
        first_extra = found.old
        extra = ""
        if found.new > first_extra:
            op = graph.order[first_extra].op
            extra = (
                f"; the first extra op is {misses.describe_op(op.key)}"
                f"{_recorded_at(graph, first_extra)}"
            )
        return f"{found.new} ops vs {found.old} in {nearest}, the same up to there{extra}"
    if what == "outputs":
        return (
            f"the same ops, but {found.new} live tensors to compute vs {found.old} in {nearest} "
            "(a tensor of the step is kept, or freed, where it was not before)"
        )
    if what == "layout":
        moved = "" if found.new is None else f"; the first is `{input_names[found.new]}`"
        return (
            "the same ops, but their inputs come packed differently (Note [Packed state]): "
            f"the previous step returned other small results than the one before it{moved}"
        )
    if what == "precision":
        return f"torch's float32 precision settings {found.new} differ from {nearest}'s {found.old}"
    return (
        f"the same ops, but other input buffers can be reused ({nearest}'s donations differ: "
        "a tensor that was free is held now, or the other way round)"
    )


def _name_diff(new, old):
    if old is None:
        return ""
    left = list(old)
    added = []
    for n in new:
        if n in left:
            left.remove(n)
        else:
            added.append(n)
    parts = []
    if added:
        parts.append("new: " + _some(added))
    if left:
        parts.append("no longer inputs: " + _some(left))
    return f"; {'; '.join(parts)}" if parts else ""


def _some(names_, shown=4):
    text = ", ".join(f"`{n}`" for n in names_[:shown])
    return text + (f" and {len(names_) - shown} more" if len(names_) > shown else "")


# --- which user line recorded an op (TORCHACC_DEBUG=1 only) ------------------------------------

_op_ranges: list = [[], []]  # (previous step's, this step's) [(first seq, last seq, Site)]


def tag_ops(first, last, site):
    """Nodes with ``first < seq < last`` were recorded by the user's line ``site``."""
    _op_ranges[1].append((first, last, site))


def op_site(seq):
    """The user's line that recorded the node numbered ``seq``, or None (not tagged)."""
    for ranges in (_op_ranges[1], _op_ranges[0]):
        at = bisect.bisect_right(ranges, (seq, float("inf"))) - 1
        if at >= 0 and ranges[at][0] < seq < ranges[at][1]:
            return ranges[at][2]
    return None


def _recorded_at(graph, i):
    site = op_site(graph.order[i].seq)
    if site is not None:
        return f", recorded at {site}"
    if not debug():
        return ", TORCHACC_DEBUG=1 tells where it was recorded"
    return ""


compiler.on_miss[0] = on_miss
known.site_of[0] = lambda node: op_site(node.seq) or sites.user_site(sites.caller(3))
