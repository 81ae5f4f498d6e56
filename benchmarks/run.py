#!/usr/bin/env python
"""Side by side: eager PyTorch vs torch.compile (Inductor) vs torchacc (``--compiler-opt``).

    python benchmarks/run.py --models resnet50,gpt2 --nproc 1 --repeats 3 --out benchmarks/out
    python benchmarks/run.py --quick            # tiny sizes on CPU, a few minutes

Every run is one launcher process (``launch_single_task.py ... --output JSON``); runs are
interleaved (repeat -> model -> mode) so machine drift hits every mode alike. A failed run is
recorded as an error row, never stops the benchmark. Writes ``results.json``, ``results.md``
and ``results.png`` under ``--out``; see benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "launch_single_task.py")
WORKER = os.path.join(ROOT, "benchmarks", "_worker.py")

MODES = {  # name -> extra launcher flags
    "eager": [],
    "torch.compile": ["--torch_compile"],
    "torchacc": ["--compiler-opt"],
}
MODE_ALIASES = {"compile": "torch.compile", "inductor": "torch.compile", "acc": "torchacc"}

# Per model: launcher flags for a full run (GPU sizes) and for --quick (tiny, CPU).
FULL = {
    "resnet50": ["--batch_size", "128", "--image_size", "224"],
    "gpt2": ["--batch_size", "8", "--seq_len", "1024"],
}
QUICK = {
    "resnet50": ["--batch_size", "4", "--image_size", "32", "--mock_samples", "256"],
    "gpt2": ["--model", "gpt-tiny", "--batch_size", "8", "--seq_len", "64"],
}
QUICK_STEPS, QUICK_WARMUP = 8, 3
FULL_STEPS, FULL_WARMUP = 60, 10


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,gpt2", help="comma-separated gallery models")
    p.add_argument(
        "--modes", default="eager,torch.compile,torchacc", help="subset of " + ",".join(MODES)
    )
    p.add_argument("--nproc", type=int, default=1, help="processes per run (--nproc_per_node)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few steps (CPU, minutes)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (incl. warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps excluded from rates")
    p.add_argument("--batch_size", type=int, default=None, help="override every model's batch")
    p.add_argument("--amp_level", choices=("O0", "O1"), default=None, help="default: O1 on GPU")
    p.add_argument("--amp_dtype", choices=("bf16", "fp16"), default=None, help="default bf16")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument(
        "--warm-cache",
        action="store_true",
        help="share torchacc's on-disk compile cache between runs (default: fresh per run, "
        "so time to first step includes the XLA compile every time)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"))
    p.add_argument("--extra", default="", help="extra launcher flags, one string")
    args = p.parse_args(argv)
    modes = []
    for m in args.modes.split(","):
        m = MODE_ALIASES.get(m.strip(), m.strip())
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        modes.append(m)
    args.modes = modes
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else FULL_STEPS
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else FULL_WARMUP
    if args.warmup >= args.steps:
        p.error("--warmup must be < --steps")
    if args.timeout is None:
        args.timeout = 900.0 if args.quick else 3600.0
    return args


def launcher_flags(args, model: str, mode: str, gpu: bool, output: str) -> list[str]:
    sizes = list((QUICK if args.quick else FULL).get(model, []))
    if "--model" not in sizes:
        sizes = ["--model", model, *sizes]
    if args.batch_size is not None:
        i = sizes.index("--batch_size") if "--batch_size" in sizes else None
        if i is None:
            sizes += ["--batch_size", str(args.batch_size)]
        else:
            sizes[i + 1] = str(args.batch_size)
    amp_level = args.amp_level or ("O1" if gpu else "O0")
    flags = [
        *sizes,
        "--nproc_per_node",
        str(args.nproc),
        "--max_steps",
        str(args.steps),
        "--warmup_steps",
        str(args.warmup),
        "--log_interval",
        str(args.steps),
        "--amp_level",
        amp_level,
        "--output",
        output,
        *MODES[mode],
    ]
    if amp_level == "O1":
        flags += ["--amp_dtype", args.amp_dtype or "bf16"]
    if args.extra:
        flags += args.extra.split()
    return flags


def _error_line(text: str) -> str:
    """The most telling line of a failed run's output: the last exception line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
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
    dyn = metrics.get("dynamo")
    if dyn:
        out["compiles"] = dyn.get("stats", {}).get("unique_graphs")
        out["recompiles"] = sum(dyn.get("recompiles", {}).values())
        out["graph_breaks"] = sum(dyn.get("graph_break", {}).values())
    return out


def _ms(s):
    return None if s is None else s * 1000.0


def run_one(args, model, mode, repeat, gpu, logdir) -> dict:
    tag = f"{model}.{mode}.r{repeat}"
    output = os.path.join(logdir, tag + ".json")
    metrics_path = os.path.join(logdir, tag + ".metrics.json")
    flags = launcher_flags(args, model, mode, gpu is not None, output)
    if args.nproc == 1:
        cmd = [sys.executable, WORKER, metrics_path, "--", *flags]
    else:  # several workers: the plain launcher (no compiler counters)
        cmd = [sys.executable, LAUNCHER, *flags]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "" if gpu else "cpu")
    cache_tmp = None
    if mode == "torchacc" and not args.warm_cache:
        cache_tmp = tempfile.TemporaryDirectory(prefix="torchacc-bench-cache-")
        env["TORCHACC_CACHE_DIR"] = cache_tmp.name
    for p in (output, metrics_path):
        if os.path.exists(p):
            os.remove(p)
    row = {"model": model, "mode": mode, "repeat": repeat, "command": " ".join(cmd)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        text += f"\nTimeoutError: run exceeded --timeout {args.timeout:.0f} s"
        rc = -1
    finally:
        if cache_tmp is not None:
            cache_tmp.cleanup()
    row["wall_s"] = time.perf_counter() - t0
    log = os.path.join(logdir, tag + ".log")
    with open(log, "w") as f:
        f.write(text)
    row["log"] = os.path.relpath(log, ROOT)
    metrics = None
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = json.load(f)
    if rc != 0 or not os.path.exists(output):
        row["error"] = (metrics or {}).get("error") or _error_line(text)
        row["returncode"] = rc
        row.update(compiler_stats(metrics, 0))
        return row
    with open(output) as f:
        result = json.load(f)
    s = result["summary"]
    steady = s["steps_run"] - s["warmup_steps"]
    row.update(
        samples_per_sec=s["steady_samples_per_sec"],
        tokens_per_sec=s.get("steady_tokens_per_sec"),
        step_time_ms=_ms(s["steady_step_time_s"]),
        first_step_s=s["first_step_time_s"],
        warmup_s=sum(result["step_times"][: s["warmup_steps"]]),
        peak_mem_gib=s["peak_mem_gib"],
        peak_mem_source=s["peak_mem_source"],
        final_loss=s["final_loss"],
        device=s["device"],
        amp=s["amp"],
        world_size=s["world_size"],
        steps=s["steps_run"],
        warmup_steps=s["warmup_steps"],
        launched_model=result["config"].get("model"),
        batch_size=result["config"].get("batch_size"),
    )
    row.update(compiler_stats(metrics, steady))
    return row


def summarize(rows: list[dict], models, modes) -> list[dict]:
    out = []
    for model in models:
        base = None
        for mode in modes:
            runs = [r for r in rows if r["model"] == model and r["mode"] == mode]
            ok = [r for r in runs if "error" not in r]
            sps = [r["samples_per_sec"] for r in ok]
            s = {
                "model": model,
                "mode": mode,
                "runs": len(runs),
                "ok": len(ok),
                "errors": sorted({r["error"] for r in runs if "error" in r}),
            }
            if ok:
                s.update(
                    samples_per_sec=_median(sps),
                    samples_per_sec_min=min(sps),
                    samples_per_sec_max=max(sps),
                    tokens_per_sec=_median([r.get("tokens_per_sec") for r in ok]),
                    step_time_ms=_median([r["step_time_ms"] for r in ok]),
                    first_step_s=_median([r["first_step_s"] for r in ok]),
                    peak_mem_gib=max(r["peak_mem_gib"] for r in ok),
                    peak_mem_source=ok[0]["peak_mem_source"],
                    device=ok[0]["device"],
                    amp=ok[0]["amp"],
                    launched_model=ok[0]["launched_model"],
                    batch_size=ok[0]["batch_size"],
                )
                for key in (
                    "compiles",
                    "recompiles",
                    "graph_breaks",
                    "trace_ms_per_step",
                    "sync_ms_per_step",
                    "compile_time_s",
                ):
                    vals = [r.get(key) for r in ok if r.get(key) is not None]
                    if vals:
                        s[key] = _median(vals)
                fb = sorted({op for r in ok for op in r.get("fallback_ops", [])})
                if fb:
                    s["fallback_ops"] = fb
            if mode == "eager" and ok:
                base = s
            if base and ok:
                s["speedup_vs_eager"] = s["samples_per_sec"] / base["samples_per_sec"]
                if base["peak_mem_gib"]:
                    s["mem_vs_eager"] = s["peak_mem_gib"] / base["peak_mem_gib"]
            out.append(s)
    return out


def _f(x, fmt):
    return "–" if x is None else format(x, fmt)


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [
        f"Device: {meta['device']} · AMP {meta['amp_level']} · {meta['repeats']} repeat(s) · "
        f"{meta['steps']} steps ({meta['warmup']} warm-up excluded) · nproc {meta['nproc']} · "
        f"{meta['date']} · `{meta['command']}`",
        "",
        "| model | mode | samples/s (median [min–max]) | × eager | step ms | first step s "
        "| peak mem GiB (× eager) | compiles / recompiles | trace ms/step | sync ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        name = s["model"] + (
            f" ({s['launched_model']}, b{s['batch_size']})" if s.get("launched_model") else ""
        )
        if not s["ok"]:
            err = "; ".join(s["errors"]).replace("|", "\\|")
            lines.append(f"| {name} | {s['mode']} | **error**: {err} | | | | | | | |")
            continue
        sps = (
            f"{s['samples_per_sec']:.1f} [{s['samples_per_sec_min']:.1f}–"
            f"{s['samples_per_sec_max']:.1f}]"
        )
        if s["errors"]:
            sps += f" ({s['runs'] - s['ok']} failed)"
        mem = _f(s["peak_mem_gib"], ".3f")
        if s.get("mem_vs_eager") is not None:
            mem += f" ({s['mem_vs_eager']:.2f}×)"
        comp = f"{_f(s.get('compiles'), '.0f')} / {_f(s.get('recompiles'), '.0f')}"
        lines.append(
            f"| {name} | {s['mode']} | {sps} | {_f(s.get('speedup_vs_eager'), '.2f')} "
            f"| {_f(s['step_time_ms'], '.1f')} | {_f(s['first_step_s'], '.2f')} | {mem} "
            f"| {comp} | {_f(s.get('trace_ms_per_step'), '.1f')} "
            f"| {_f(s.get('sync_ms_per_step'), '.1f')} |"
        )
    lines.append("")
    fb = [f"{s['model']}: {', '.join(s['fallback_ops'])}" for s in summary if s.get("fallback_ops")]
    if fb:
        lines.append("torchacc CPU fallback ops: " + "; ".join(fb))
        lines.append("")
    return "\n".join(lines)


def plot(summary: list[dict], models, modes, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; skipped the PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(2.5 + 2.2 * len(models), 4))
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
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("samples/s relative to eager (median, min–max)")
    ax.set_title("torchacc benchmarks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = detect_gpu()
    os.makedirs(args.out, exist_ok=True)
    logdir = os.path.join(args.out, "runs")
    os.makedirs(logdir, exist_ok=True)
    meta = {
        "command": " ".join(
            ["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu
        or f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "host": platform.node(),
        "amp_level": args.amp_level or ("O1" if gpu else "O0"),
        "amp_dtype": args.amp_dtype or "bf16",
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "nproc": args.nproc,
        "quick": args.quick,
        "python": platform.python_version(),
    }
    rows: list[dict] = []
    for r in range(args.repeats):
        for model in args.models:
            for mode in args.modes:
                print(f"[bench] repeat {r + 1}/{args.repeats} {model} {mode} ...", flush=True)
                row = run_one(args, model, mode, r, gpu, logdir)
                rows.append(row)
                if "error" in row:
                    print(f"[bench]   ERROR ({row['wall_s']:.0f} s): {row['error']}", flush=True)
                else:
                    print(
                        f"[bench]   {row['samples_per_sec']:.1f} samples/s, "
                        f"{row['step_time_ms']:.1f} ms/step, first step {row['first_step_s']:.2f}"
                        f" s ({row['wall_s']:.0f} s wall)",
                        flush=True,
                    )
    summary = summarize(rows, args.models, args.modes)
    md = markdown(summary, meta)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": rows}, f, indent=1, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    note = plot(summary, args.models, args.modes, os.path.join(args.out, "results.png"))
    print()
    print(md)
    if note:
        print(note)
    kinds = "json,md" if note else "json,md,png"
    print(f"[bench] wrote {os.path.relpath(args.out)}/results.{{{kinds}}}")
    # Non-zero only if no run at all succeeded.
    return 0 if any("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
