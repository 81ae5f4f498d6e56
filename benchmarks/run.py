#!/usr/bin/env python
"""Side by side: eager PyTorch vs torch.compile (Inductor) vs torchacc (``--compiler-opt``).

    python benchmarks/run.py --models resnet50,gpt2 --nproc 1 --repeats 3 --out benchmarks/out
    python benchmarks/run.py --quick            # tiny sizes on CPU, a few minutes
    python benchmarks/run.py --quick --tensorboard tb && tensorboard --logdir tb  # the curves

Every run is one launcher process (``launch_single_task.py ... --output JSON``); runs are
interleaved (repeat -> model -> mode) so machine drift hits every mode alike. A failed run is
recorded as an error row and the benchmark goes on, but the exit status is 1 if any run failed
(each failed run is named). Writes ``results.json``, ``results.md`` and ``results.png`` under
``--out``; see benchmarks/README.md for the columns. With ``--tensorboard DIR`` every run also
writes the launcher's TensorBoard scalars to ``DIR/<model>/<mode>`` (``-r<N>`` added when there
are several repeats), so the modes are runs side by side in one TensorBoard.

Note [busy box]: a benchmark on a loaded machine measures the load, not the modes. The 1-min load
average is sampled before and after every run; if it exceeds the core count, or the samples/s of
any model x mode spread by more than ``run_stats.SPREAD_LIMIT`` (max-min over median) across
repeats, the results carry ``"busy": true`` with the reasons and a WARNING line is printed and
written.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded by path
from run_stats import (  # noqa: E402  (benchmarks/run_stats.py: what is read from the runs)
    _error_line,
    _load1,
    _median,
    _ms,
    busy_check,
    compiler_stats,
    detect_gpu,
    failures,
    plot,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _flops  # noqa: E402  (model FLOPs per step: the MFU numerator)

LAUNCHER = os.path.join(ROOT, "launch_single_task.py")
WORKER = os.path.join(ROOT, "benchmarks", "_worker.py")

MODES = {  # name -> extra launcher flags
    "eager": [],
    "torch.compile": ["--torch_compile"],
    "torchacc": ["--compiler-opt"],
    # torchacc with the step compiled through torch.compile's Dynamo frontend (not in defaults).
    "torchacc-dynamo": ["--compiler-opt", "--compile_mode=dynamo"],
}
DEFAULT_MODES = "eager,torch.compile,torchacc,torchacc-dynamo"
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,gpt2", help="comma-separated gallery models")
    p.add_argument("--modes", default=DEFAULT_MODES, help="subset of " + ",".join(MODES))
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
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s for the MFU column (default: from the device kind "
        "in torchacc.hardware; a CPU has none: MFU n/a)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="each run writes its scalars (launcher --tensorboard) to DIR/<model>/<mode>",
    )
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


def launcher_flags(
    args, model: str, mode: str, gpu: bool, output: str, repeat: int = 0
) -> list[str]:
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
    if args.tensorboard:
        flags += ["--tensorboard", tensorboard_run(args, model, mode, repeat)]
    if args.extra:
        flags += args.extra.split()
    return flags


def tensorboard_run(args, model: str, mode: str, repeat: int) -> str:
    """The TensorBoard run directory of one benchmark run (absolute: the launcher's cwd is
    ROOT)."""
    name = mode if args.repeats == 1 else f"{mode}-r{repeat + 1}"
    return os.path.abspath(os.path.join(args.tensorboard, model, name))


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags[:-1] else None


def model_label(args, model: str) -> str:
    """What actually runs for ``model``: the launcher's ``--model`` and sizes (never an alias)."""
    flags = launcher_flags(args, model, "eager", False, "-")
    sizes = [f"batch {_flag(flags, '--batch_size') or '?'}"]
    if _flag(flags, "--seq_len"):
        sizes.append(f"seq {_flag(flags, '--seq_len')}")
    if _flag(flags, "--image_size"):
        sizes.append(f"{_flag(flags, '--image_size')}x{_flag(flags, '--image_size')}")
    return f"{_flag(flags, '--model')} ({', '.join(sizes)})"


def run_one(args, model, mode, repeat, gpu, logdir) -> dict:
    tag = f"{model}.{mode}.r{repeat}"
    # The launcher runs with cwd=ROOT: hand it absolute paths, show the user's spelling.
    output = os.path.abspath(os.path.join(logdir, tag + ".json"))
    metrics_path = os.path.abspath(os.path.join(logdir, tag + ".metrics.json"))
    flags = launcher_flags(args, model, mode, gpu is not None, output, repeat)
    if args.nproc == 1:
        cmd = [sys.executable, WORKER, metrics_path, "--", *flags]
    else:  # several workers: the plain launcher (no compiler counters)
        cmd = [sys.executable, LAUNCHER, *flags]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "" if gpu else "cpu")
    cache_tmp = None
    if mode.startswith("torchacc") and not args.warm_cache:
        cache_tmp = tempfile.TemporaryDirectory(prefix="torchacc-bench-cache-")
        env["TORCHACC_CACHE_DIR"] = cache_tmp.name
    for p in (output, metrics_path):
        if os.path.exists(p):
            os.remove(p)
    row = {"model": model, "mode": mode, "repeat": repeat, "command": " ".join(cmd)}
    row["loadavg_before"] = _load1()
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
    row["loadavg_after"] = _load1()
    log = os.path.join(logdir, tag + ".log")
    with open(log, "w") as f:
        f.write(text)
    row["log"] = log
    metrics = None
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = json.load(f)
    if rc != 0 or not os.path.exists(output):
        err = (metrics or {}).get("error")
        row["error"] = _error_line(text) if not err or err.startswith("SystemExit") else err
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
    row.update(flops_stats(args, flags, row, metrics, gpu))
    return row


def peak_flops(args, gpu: str | None) -> float | None:
    """Dense peak FLOP/s of the device for MFU: ``--peak_tflops``, else torchacc.hardware's
    entry for the device kind (bf16 with AMP O1, else fp32); None on a CPU or an unknown part."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if not gpu:
        return None
    from torchacc import hardware

    acc = hardware.from_device_kind(gpu)
    if acc is None:
        return None
    return acc.peak("bfloat16" if (args.amp_level or "O1") == "O1" else "float32")


def flops_stats(args, flags: list[str], row: dict, metrics: dict | None, gpu) -> dict:
    """Model TFLOP/s (the model's arithmetic, benchmarks/_flops.py: the same for every mode), MFU
    against the device's peak, and for torchacc the step program's TFLOP/s from XLA's cost
    analysis (Note [Step FLOPs] in torchacc/metrics.py)."""
    out: dict = {}
    step_s = (row.get("step_time_ms") or 0.0) / 1000.0
    if step_s <= 0:
        return out
    model_flops, _how = _flops.from_launcher_flags(flags)
    if model_flops:
        out["tflops"] = model_flops / step_s / 1e12
        peak = peak_flops(args, gpu)
        out["mfu"] = model_flops / step_s / peak if peak else None
    xla = ((metrics or {}).get("torchacc") or {}).get("step_flops")
    if xla:
        out["xla_tflops"] = xla / step_s / 1e12
    return out


def summarize(rows: list[dict], models, modes, labels: dict) -> list[dict]:
    out = []
    for model in models:
        base = None
        for mode in modes:
            runs = [r for r in rows if r["model"] == model and r["mode"] == mode]
            ok = [r for r in runs if "error" not in r]
            sps = [r["samples_per_sec"] for r in ok]
            s = {
                "model": model,
                "label": labels[model],
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
                    spread=(max(sps) - min(sps)) / _median(sps),
                    tokens_per_sec=_median([r.get("tokens_per_sec") for r in ok]),
                    step_time_ms=_median([r["step_time_ms"] for r in ok]),
                    first_step_s=_median([r["first_step_s"] for r in ok]),
                    peak_mem_gib=max(r["peak_mem_gib"] for r in ok),
                    peak_mem_source=ok[0]["peak_mem_source"],
                    device=ok[0]["device"],
                    amp=ok[0]["amp"],
                )
                for key in (
                    "compiles",
                    "recompiles",
                    "step_traces",
                    "graph_breaks",
                    "trace_ms_per_step",
                    "sync_ms_per_step",
                    "compile_time_s",
                    "tflops",
                    "mfu",
                    "xla_tflops",
                ):
                    vals = [r.get(key) for r in ok if r.get(key) is not None]
                    if vals:
                        s[key] = _median(vals)
                if len(sps) >= 4:
                    q1, _, q3 = statistics.quantiles(sps, n=4)
                    s["samples_per_sec_iqr"] = [q1, q3]
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
        *[f"**WARNING: busy box**: {w}" for w in meta.get("warnings", [])],
        *([""] if meta.get("warnings") else []),
        "| model | mode | samples/s (median [min–max], spread) | × eager | tokens/s | step ms "
        "| TFLOP/s (XLA) | MFU | first step s | peak mem GiB (× eager) | compiles / recompiles "
        "| trace ms/step | sync ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        name = s["label"]
        if not s["ok"]:
            err = "; ".join(s["errors"]).replace("|", "\\|")
            lines.append(f"| {name} | {s['mode']} | **error**: {err} | | | | | | | | | | |")
            continue
        sps = (
            f"{s['samples_per_sec']:.1f} [{s['samples_per_sec_min']:.1f}–"
            f"{s['samples_per_sec_max']:.1f}] spread {100 * s['spread']:.0f}%"
        )
        if s["errors"]:
            sps += f" ({s['runs'] - s['ok']} failed)"
        mem = _f(s["peak_mem_gib"], ".3f")
        if s.get("mem_vs_eager") is not None:
            mem += f" ({s['mem_vs_eager']:.2f}×)"
        comp = f"{_f(s.get('compiles'), '.0f')} / {_f(s.get('recompiles'), '.0f')}"
        tflops = _f(s.get("tflops"), ".3g")
        if s.get("xla_tflops") is not None:
            tflops += f" ({s['xla_tflops']:.3g})"
        mfu = "n/a" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"
        lines.append(
            f"| {name} | {s['mode']} | {sps} | {_f(s.get('speedup_vs_eager'), '.2f')} "
            f"| {_f(s.get('tokens_per_sec'), ',.0f')} | {_f(s['step_time_ms'], '.1f')} "
            f"| {tflops} | {mfu} | {_f(s['first_step_s'], '.2f')} | {mem} "
            f"| {comp} | {_f(s.get('trace_ms_per_step'), '.1f')} "
            f"| {_f(s.get('sync_ms_per_step'), '.1f')} |"
        )
    lines.append("")
    fb = [f"{s['label']}: {', '.join(s['fallback_ops'])}" for s in summary if s.get("fallback_ops")]
    if fb:
        lines.append("torchacc CPU fallback ops: " + "; ".join(fb))
        lines.append("")
    return "\n".join(lines)


def run_all(args, gpu, logdir) -> list[dict]:
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
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = detect_gpu()
    os.makedirs(args.out, exist_ok=True)
    logdir = os.path.join(args.out, "runs")
    os.makedirs(logdir, exist_ok=True)
    labels = {m: model_label(args, m) for m in args.models}
    meta = {
        "command": " ".join(
            ["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu
        or f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "host": platform.node(),
        "cores": os.cpu_count(),
        "amp_level": args.amp_level or ("O1" if gpu else "O0"),
        "amp_dtype": args.amp_dtype or "bf16",
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "nproc": args.nproc,
        "quick": args.quick,
        "models": labels,
        "python": platform.python_version(),
    }
    rows = run_all(args, gpu, logdir)
    summary = summarize(rows, args.models, args.modes, labels)
    loads, reasons = busy_check(rows, summary)
    meta.update(busy=bool(reasons), loadavg=loads, warnings=reasons)
    md = markdown(summary, meta)
    paths = {k: os.path.join(args.out, "results." + k) for k in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": rows}, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write(md)
    note = plot(summary, args.models, args.modes, meta, paths["png"])
    print()
    print(md)
    if note:
        print(note)
    for w in reasons:
        print(f"[bench] WARNING: busy box: {w}", flush=True)
    written = [p for k, p in paths.items() if not (note and k == "png")]
    print(f"[bench] wrote {', '.join(written)}")
    failed = failures(rows)
    if failed:
        print(f"[bench] FAILED: {len(failed)} of {len(rows)} runs:", file=sys.stderr)
        for line in failed:
            print(f"[bench]   {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
