"""What ``benchmarks/run.py`` reads from its runs and the machine: the accelerator's name, the
compiler counters of a run (compiles, recompiles, trace and sync time per step), the telling line
of a failed run, the busy-box check (Note [busy box] in run.py) and the results' PNG.
"""

from __future__ import annotations

import os
import statistics

SPREAD_LIMIT = 0.20  # max-min over median of samples/s across repeats; see Note [busy box]


def detect_gpu() -> str | None:
    """A name for the accelerator, or None (CPU only)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return None
    try:
        import jax

        gpus = [d for d in jax.devices() if d.platform in ("gpu", "cuda", "rocm")]
        if gpus:
            return str(gpus[0].device_kind)
    except Exception:
        pass
    return None


def _error_line(text: str) -> str:
    """The most telling line of a failed run's output: the last exception line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:  # argparse's "prog: error: ..." says more than its SystemExit
        if ": error: " in ln and not ln.startswith(("self.", "File ")):
            return ln[:400]
    for ln in reversed(lines):
        if (
            ("Error" in ln or "Exception" in ln)
            and not ln.startswith("File ")
            and "ChildFailedError" not in ln
        ):
            return ln[:400]
    return (lines[-1] if lines else "no output")[:400]


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def compiler_stats(metrics: dict | None, steady_steps: int) -> dict:
    """Compiles/recompiles and, for torchacc, host trace vs sync time per steady step."""
    out: dict = {}
    if not metrics:
        return out
    acc = metrics.get("torchacc")
    if acc:
        c, t = acc.get("counters", {}), acc.get("timings", {})
        out["compiles"] = (c.get("UncachedCompile") or 0) + (c.get("PersistentCacheHit") or 0)
        out["disk_cache_hits"] = c.get("PersistentCacheHit") or 0
        out["cached_compiles"] = c.get("CachedCompile") or 0
        out["mark_steps"] = c.get("MarkStep") or 0
        out["fallback_ops"] = acc.get("fallback_ops", [])
        out["compile_time_s"] = sum(t.get("CompileTime", []))
        trace, sync = t.get("TraceTime", []), t.get("SyncTime", [])
        if steady_steps > 0:
            # The last steady_steps mark_steps are the steady-state steps.
            out["trace_ms_per_step"] = _ms(_median(trace[-steady_steps:]))
            out["sync_ms_per_step"] = _ms(_median(sync[-steady_steps:]))
    if acc and _trace_once(acc.get("counters", {}), out):
        return out  # torchacc-dynamo: torchacc.metrics has its own compile counters
    dyn = metrics.get("dynamo")
    if dyn:
        out["compiles"] = dyn.get("stats", {}).get("unique_graphs")
        out["recompiles"] = sum(dyn.get("recompiles", {}).values())
        out["graph_breaks"] = sum(dyn.get("graph_break", {}).values())
    return out


def _trace_once(c: dict, out: dict) -> bool:
    """torchacc.dynamo's counters (compile_step or the torch.compile backend): XLA compiles,
    recompiles after a guard change, whole-step traces. False when the run did not use it."""
    if not (c.get("StepTrace") or c.get("DynamoGraph")):
        return False
    out["compiles"] = c.get("DynamoCompile") or 0
    out["recompiles"] = (c.get("StepRecompile") or 0) + (c.get("DynamoRecompile") or 0)
    out["step_traces"] = c.get("StepTrace") or 0
    return True


def _ms(s):
    return None if s is None else s * 1000.0


def _load1() -> float | None:
    """The 1-min load average, or None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def plot(summary: list[dict], models, modes, meta: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; skipped the PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(4 + 2.2 * len(models), 4.5))
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for i, model in enumerate(models):
            s = next((s for s in summary if s["model"] == model and s["mode"] == mode), None)
            if s is None or not s["ok"]:
                ax.text(
                    i + (j - (len(modes) - 1) / 2) * width,
                    0.02,
                    "error",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color="red",
                )
                continue
            base = next(
                (b for b in summary if b["model"] == model and b["mode"] == "eager" and b["ok"]),
                None,
            )
            norm = base["samples_per_sec"] if base else s["samples_per_sec"]
            xs.append(i + (j - (len(modes) - 1) / 2) * width)
            ys.append(s["samples_per_sec"] / norm)
            lo.append((s["samples_per_sec"] - s["samples_per_sec_min"]) / norm)
            hi.append((s["samples_per_sec_max"] - s["samples_per_sec"]) / norm)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=mode)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    labels = [next(s["label"] for s in summary if s["model"] == m) for m in models]
    ax.set_xticks(range(len(models)), [lb.replace(" (", "\n(") for lb in labels], fontsize=8)
    ax.set_ylabel("samples/s relative to eager (median, min–max)")
    title = f"torchacc benchmarks\n{meta['device']}, {meta['repeats']} repeat(s)"
    ax.set_title(title + (" - BUSY BOX, see warnings" if meta.get("busy") else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def busy_check(rows: list[dict], summary: list[dict]) -> tuple[list[float], list[str]]:
    """The load samples and why the box looked busy (empty: quiet); see Note [busy box]."""
    cores = os.cpu_count() or 1
    keys = ("loadavg_before", "loadavg_after")
    loads = [r[k] for r in rows for k in keys if r.get(k) is not None]
    reasons = []
    if loads and max(loads) > cores:
        reasons.append(
            f"1-min load average reached {max(loads):.2f} (> {cores} cores) before/after runs; "
            "other work competed with the benchmark"
        )
    for s in summary:
        if s["ok"] and s.get("spread", 0.0) > SPREAD_LIMIT:
            reasons.append(
                f"{s['label']} {s['mode']}: samples/s spread {100 * s['spread']:.0f}% over "
                f"{s['ok']} repeats (> {100 * SPREAD_LIMIT:.0f}%)"
            )
    return loads, reasons


def failures(rows: list[dict]) -> list[str]:
    """One line per failed run: which model, mode and repeat, and its error."""
    return [
        f"{r['model']} {r['mode']} repeat {r['repeat'] + 1}: {r['error']} (log: {r['log']})"
        for r in rows
        if "error" in r
    ]
