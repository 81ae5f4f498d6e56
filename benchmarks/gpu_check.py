#!/usr/bin/env python
"""The one-GPU check: eager vs torch.compile vs torchacc on ResNet-50, GPT-2 and LLaMA-1B.

    PYTHONPATH=. python benchmarks/gpu_check.py --out OUT --budget_s 470   # one H100, <= 8 min
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke --out /tmp/gc       # CPU, same code paths

Every run is one launcher process (``benchmarks/_worker.py`` around ``launch_single_task.py``'s
flags, as in ``benchmarks/run.py``) with its own timeout. After each run its numbers are appended
to ``OUT/results.jsonl`` and ``OUT/results.md`` is rewritten, so a crash or a timeout loses only
that run. Runs go in priority order; when the remaining ``--budget_s`` is shorter than a run's
expected cost the run is skipped (a ``skipped`` row) and the next cheaper one is tried. The plan's
estimates (``torchacc.plan``, when importable) are computed beside the runs in a CPU-only
subprocess (``JAX_PLATFORMS=cpu``, niced) so they cost no GPU time.

Per run: throughput (tokens/s, img/s), step time, model TFLOP/s and MFU (analytic model FLOPs:
6N + 12·L·d·T per token for the transformers, the FLOP count of ResNet-50's forward and backward
for images; the same numerator for every side), the torchacc step program's FLOPs from XLA's cost
analysis where the run exposes them, peak device memory, the loss at the first and last step
against eager's (same seed, same data), and the plan's estimate. See docs/mfu.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_worker.py")
RESERVE_S = 8.0  # kept back from --budget_s for the final table


def _load_run_module():
    """benchmarks/run.py (error-line and compiler-counter helpers), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "_bench_run", os.path.join(ROOT, "benchmarks", "run.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_run_module()
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _flops  # noqa: E402
from gpu_check_context import (  # noqa: E402  (the machine and the plan's estimates)
    nvidia_smi,
    peak_flops,
    plan_summary,
    probe_environment,
    read_plans,
    start_plans,
)
from gpu_check_runs import RUNS, SIDES, WORKLOADS  # noqa: E402  (what the check runs)

# ----------------------------------------------------------------------------- the runs


GPU_STEPS, GPU_WARMUP = 30, 10
SMOKE_STEPS, SMOKE_WARMUP = 4, 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for results.jsonl, results.md, logs")
    p.add_argument(
        "--budget_s",
        type=float,
        default=None,
        help="total wall-clock seconds for the whole check (default 470; 900 with --smoke); runs "
        "that no longer fit are skipped",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, same code paths")
    p.add_argument("--only", default=None, help="comma-separated run ids (see --list)")
    p.add_argument("--list", action="store_true", help="print the runs in order and exit")
    p.add_argument("--steps", type=int, default=None, help="steps per run incl. warm-up")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps left out of rates")
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s for MFU (default: from the device kind; CPU: n/a)",
    )
    p.add_argument("--no_plan", action="store_true", help="skip the torchacc.plan estimates")
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 900.0 if args.smoke else 470.0
    args.steps = args.steps or (SMOKE_STEPS if args.smoke else GPU_STEPS)
    args.warmup = (
        args.warmup if args.warmup is not None else (SMOKE_WARMUP if args.smoke else GPU_WARMUP)
    )
    if args.out is None and not args.list:
        p.error("--out DIR is required (where results.jsonl, results.md and the logs go)")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be < --steps {args.steps}")
    ids = [r[0] for r in RUNS]
    if args.only:
        want = [x.strip() for x in args.only.split(",") if x.strip()]
        bad = [x for x in want if x not in ids]
        if bad:
            p.error(f"--only: unknown run(s) {', '.join(bad)}; known: {', '.join(ids)}")
        args.only = want
    return args


def launcher_flags(args, workload: str, side: str, fsdp: bool, output: str) -> list[str]:
    flags = list(WORKLOADS[workload]["smoke" if args.smoke else "gpu"])
    amp = ["--amp_level", "O0"] if args.smoke else ["--amp_level", "O1", "--amp_dtype", "bf16"]
    flags += [
        "--max_steps",
        str(args.steps),
        "--warmup_steps",
        str(args.warmup),
        "--log_interval",
        str(args.steps),
        *amp,
        "--output",
        output,
        *SIDES[side],
    ]
    if fsdp:
        flags.append("--fsdp")
    return flags


# ----------------------------------------------------------------------------- model FLOPs
def model_flops_per_step(args, workload: str) -> tuple[float | None, str]:
    """Training FLOPs of one step by the model's arithmetic (benchmarks/_flops.py)."""
    return _flops.from_launcher_flags(WORKLOADS[workload]["smoke" if args.smoke else "gpu"])


# ----------------------------------------------------------------------------- one run
def run_one(args, run, env, logdir, timeout, model_flops, peak) -> dict:
    rid, workload, side, fsdp, _, _ = run
    output = os.path.abspath(os.path.join(logdir, rid + ".json"))
    metrics_path = os.path.abspath(os.path.join(logdir, rid + ".metrics.json"))
    for p in (output, metrics_path):
        if os.path.exists(p):
            os.remove(p)
    flags = launcher_flags(args, workload, side, fsdp, output)
    cmd = [sys.executable, WORKER, metrics_path, "--", *flags]
    row = {
        "id": rid,
        "workload": workload,
        "side": side,
        "fsdp": fsdp,
        "command": " ".join(["python benchmarks/_worker.py M --", *flags]),
    }
    t0 = time.perf_counter()
    text, rc = _run_killable(cmd, env, timeout)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    log = os.path.join(logdir, rid + ".log")
    with open(log, "w") as f:
        f.write(text)
    row["log"] = os.path.relpath(log, args.out)
    metrics = None
    if os.path.exists(metrics_path):
        try:
            with open(metrics_path) as f:
                metrics = json.load(f)
        except ValueError:
            metrics = None
    if rc != 0 or not os.path.exists(output):
        err = (metrics or {}).get("error")
        row["error"] = bench._error_line(text) if not err or err.startswith("SystemExit") else err
        return row
    with open(output) as f:
        result = json.load(f)
    s = result["summary"]
    steady = s["steps_run"] - s["warmup_steps"]
    step_s = s["steady_step_time_s"]
    row.update(
        samples_per_sec=s["steady_samples_per_sec"],
        tokens_per_sec=s.get("steady_tokens_per_sec"),
        step_ms=None if step_s is None else step_s * 1000.0,
        first_step_s=s["first_step_time_s"],
        peak_mem_gib=s["peak_mem_gib"],
        peak_mem_source=s["peak_mem_source"],
        losses=result["losses"],
        device=s.get("hardware") or s["device"],
        amp=s["amp"],
        steps=s["steps_run"],
        timed_steps=steady,
    )
    # Steady per-step times: the median says whether the synchronized window was even.
    times = result.get("step_times", [])[s["warmup_steps"] :]
    if times:
        row["median_step_ms"] = sorted(times)[len(times) // 2] * 1000.0
    if model_flops and step_s:
        row["model_tflops"] = model_flops / step_s / 1e12
        row["mfu"] = None if not peak else model_flops / step_s / peak
    xla = step_flops_from(result, metrics)
    if xla and step_s:
        row["xla_step_flops"] = xla
        row["xla_tflops"] = xla / step_s / 1e12
    row.update(bench.compiler_stats(metrics, steady))
    row.pop("fallback_ops", None)
    return row


def _run_killable(cmd, env, timeout) -> tuple[str, int]:
    """Run ``cmd`` in its own session; on timeout kill the whole group (a compile worker pool or
    anything else it started must not hold the GPU for the next run)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            rc = proc.wait()
        try:  # children left in the group once the run itself ended
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        log.seek(0)
        text = log.read()
    if timed_out:
        text += f"\nTimeoutError: run exceeded its {timeout:.0f} s timeout"
        rc = -1
    return text, rc


def step_flops_from(result: dict, metrics: dict | None) -> float | None:
    """FLOPs of the executed step program from XLA's cost analysis, where the run reports them
    (the launcher's summary ``step_flops``, or torchacc.metrics' ``StepFlops`` in the worker's
    metrics)."""
    v = result.get("summary", {}).get("step_flops")
    if isinstance(v, (int, float)) and v > 0:
        return float(v)
    acc = (metrics or {}).get("torchacc") or {}
    v = acc.get("step_flops")
    if isinstance(v, (int, float)) and v > 0:
        return float(v)
    return None


# ----------------------------------------------------------------------------- the table
def _f(x, fmt, none="–"):
    return none if x is None else format(x, fmt)


def parity(rows: list[dict], row: dict) -> str:
    """Loss at the first and last fetched step, against the eager run of the same workload (the
    plain one for plain runs, eager FSDP for FSDP runs, else whichever eager ran)."""
    if not row.get("losses"):
        return "–"
    own = f"{row['losses'][0]:.4f}/{row['losses'][-1]:.4f}"
    if row["side"] == "eager":
        return own + " (baseline)"
    base = [
        r
        for r in rows
        if r["workload"] == row["workload"] and r["side"] == "eager" and r.get("losses")
    ]
    base.sort(key=lambda r: r["fsdp"] != row["fsdp"])  # the same fsdp setting first
    if not base:
        return own + " (no eager run)"
    a, b = base[0]["losses"], row["losses"]
    d0 = abs(b[0] - a[0]) / max(abs(a[0]), 1e-12)
    d1 = abs(b[-1] - a[-1]) / max(abs(a[-1]), 1e-12)
    return f"{own} (Δ {100 * d0:.2f}%/{100 * d1:.2f}%)"


def markdown(rows: list[dict], meta: dict, plans: dict) -> str:
    lines = [
        f"# GPU check ({meta['mode']})",
        "",
        f"{meta['date']} · `{meta['command']}` · device **{meta['device']}** · peak "
        f"{meta['peak']} · {meta['steps']} steps, {meta['warmup']} warm-up left out (rates over "
        "the synchronized window after them) · torch "
        f"{meta['env'].get('torch')} · jax {meta['env'].get('jax')} · XLA_FLAGS "
        f"`{meta['env'].get('XLA_FLAGS') or ''}` · XLA_PYTHON_CLIENT_PREALLOCATE="
        f"{meta['env'].get('XLA_PYTHON_CLIENT_PREALLOCATE')}",
        "",
        "| run | side | tokens/s or img/s | step ms (median) | model TFLOP/s | MFU | XLA TFLOP/s "
        "| peak mem GiB | first step s | loss first/last (Δ vs eager) | plan: step ms, MFU, mem "
        "GiB | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spec = WORKLOADS[r["workload"]]
        name = spec["label"]
        if meta["smoke"]:
            name = spec["smoke"][spec["smoke"].index("--model") + 1] + " (smoke)"
        if r["fsdp"]:
            name += " FSDP"
        if "skipped" in r:
            lines.append(f"| {name} | {r['side']} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        if "error" in r:
            err = r["error"].replace("|", "\\|")[:300]
            lines.append(
                f"| {name} | {r['side']} | **error**: {err} | | | | | | | | | {r['wall_s']:.0f} |"
            )
            continue
        unit = "img/s" if r["workload"] == "resnet50" else "tok/s"
        rate = r["samples_per_sec"] if unit == "img/s" else r.get("tokens_per_sec")
        mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        pkey = r["workload"] + ("-fsdp" if r["fsdp"] else "")
        ps = plan_summary(plans.get(pkey) or plans.get("*"))
        if "plan_error" in ps:
            plan_txt = "n/a"
        elif ps:
            plan_txt = (
                f"{_f(ps.get('plan_step_s') and ps['plan_step_s'] * 1000, '.3g')}, "
                f"{_f(ps.get('plan_mfu') and 100 * ps['plan_mfu'], '.1f')}%, "
                f"{_f(ps.get('plan_mem_gib'), '.2f')}"
            )
        else:
            plan_txt = "–"
        lines.append(
            f"| {name} | {r['side']} | {_f(rate, ',.0f')} {unit} "
            f"| {_f(r.get('step_ms'), '.1f')} ({_f(r.get('median_step_ms'), '.1f')}) "
            f"| {_f(r.get('model_tflops'), '.3g')} | {mfu} | {_f(r.get('xla_tflops'), '.3g')} "
            f"| {_f(r.get('peak_mem_gib'), '.2f')} | {_f(r.get('first_step_s'), '.1f')} "
            f"| {parity(rows, r)} | {plan_txt} | {r['wall_s']:.0f} |"
        )
    lines.append("")
    for line in fsdp_lines(rows):
        lines.append(line)
    lines.append("")
    lines.append(
        f"Plan column: `torchacc.plan` for {meta.get('plan_device')}, mesh dp=1 (fsdp=1 for the "
        "FSDP rows), the same batch and precision: estimated step time, MFU and memory per device."
    )
    if meta["smoke"]:
        lines.append("Smoke run: tiny shapes on the CPU; no number here is a GPU number.")
    lines.append("")
    for rid, item in sorted(plans.items()):
        if "error" in item:
            lines.append(f"plan {rid}: n/a ({item['error'][:200]})")
    lines.append("")
    return "\n".join(lines)


def fsdp_lines(rows: list[dict]) -> list[str]:
    """Issue 40: FSDP on one GPU must cost <= 5% more step time than the plain run."""
    out = []
    for side in ("torchacc", "eager"):
        plain = next((r for r in rows if r["id"] == f"gpt2.{side}" and r.get("step_ms")), None)
        fsdp = next((r for r in rows if r["id"] == f"gpt2-fsdp.{side}" and r.get("step_ms")), None)
        if plain and fsdp:
            ratio = fsdp["step_ms"] / plain["step_ms"]
            verdict = "OK (<= 1.05)" if ratio <= 1.05 else "OVER the 5% limit"
            out.append(
                f"FSDP vs plain, GPT-2 {side}, one device: step time x{ratio:.3f} "
                f"({fsdp['step_ms']:.1f} vs {plain['step_ms']:.1f} ms): {verdict}"
            )
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for rid, *_, est, cap in RUNS:
            print(f"{rid:28s} expected {est:3d} s, cap {cap:3d} s")
        return 0
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    logdir = os.path.join(args.out, "runs")
    os.makedirs(logdir, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    # JAX and torch share the GPU: no preallocation (torchacc's default, README "Sharing a GPU
    # with PyTorch"); set here too so the environment printed is the one the runs get.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.smoke:
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    cache = tempfile.mkdtemp(prefix="torchacc-gpu-check-cache-")
    env.setdefault("TORCHACC_CACHE_DIR", cache)  # one fresh compile cache for this check

    print("[gpu_check] probing the environment ...", flush=True)
    info = probe_environment(env, timeout=min(120.0, args.budget_s / 4))
    if not args.smoke:
        info["nvidia_smi"] = nvidia_smi()
    for k, v in info.items():
        print(f"[gpu_check]   {k}: {v}", flush=True)
    peak, peak_txt = peak_flops(args, info)
    sys.path.insert(0, ROOT)
    from torchacc import hardware

    acc = hardware.from_device_kind(info.get("device_kind") or info.get("torch_device") or "")
    runs = [r for r in RUNS if not args.only or r[0] in args.only]
    if args.only:
        runs.sort(key=lambda r: args.only.index(r[0]))
    workloads = [w for w in WORKLOADS if any(r[1] == w for r in runs)]
    plan_proc = start_plans(args, acc.name if acc else None, env, logdir, workloads)
    flops = {w: model_flops_per_step(args, w) for w in workloads}
    for w, (fl, how) in flops.items():
        print(f"[gpu_check]   model FLOPs/step {w}: {_f(fl, '.4g')} ({how})", flush=True)
    meta = {
        "mode": "smoke, CPU" if args.smoke else "one GPU",
        "plan_device": acc.name if acc else "h100-sxm (torchacc.plan's default)",
        "smoke": args.smoke,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(
            ["python benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "device": info.get("device_kind") or info.get("torch_device") or platform.machine(),
        "peak": peak_txt,
        "steps": args.steps,
        "warmup": args.warmup,
        "env": info,
        "model_flops": {w: fl for w, (fl, _) in flops.items()},
        "budget_s": args.budget_s,
    }
    jsonl = os.path.join(args.out, "results.jsonl")
    md_path = os.path.join(args.out, "results.md")
    with open(jsonl, "w") as f:
        f.write(json.dumps({"meta": meta}, default=str) + "\n")
    rows: list[dict] = []

    def write():
        with open(md_path, "w") as f:
            f.write(markdown(rows, meta, read_plans(logdir)))

    for run in runs:
        rid, workload, side, fsdp, est, cap = run
        left = args.budget_s - (time.perf_counter() - t_start) - RESERVE_S
        need = est * (0.5 if args.smoke else 1.0)
        if left < need:
            row = {
                "id": rid,
                "workload": workload,
                "side": side,
                "fsdp": fsdp,
                "skipped": f"budget ({left:.0f} s left, expects ~{need:.0f} s)",
            }
            print(f"[gpu_check] {rid}: skipped ({row['skipped']})", flush=True)
        else:
            timeout = min(cap * (3.0 if args.smoke else 1.0), left)
            print(f"[gpu_check] {rid} (timeout {timeout:.0f} s) ...", flush=True)
            row = run_one(args, run, env, logdir, timeout, flops[workload][0], peak)
            if "error" in row:
                print(
                    f"[gpu_check]   ERROR after {row['wall_s']:.0f} s: {row['error']}", flush=True
                )
            else:
                rate = row.get("tokens_per_sec") or row["samples_per_sec"]
                mfu = "n/a" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"
                print(
                    f"[gpu_check]   {rate:,.0f}/s, {row['step_ms']:.1f} ms/step, MFU {mfu}, "
                    f"peak {row['peak_mem_gib']:.2f} GiB, wall {row['wall_s']:.0f} s",
                    flush=True,
                )
        rows.append(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        write()
    if plan_proc is not None:
        proc, log = plan_proc
        left = max(args.budget_s - (time.perf_counter() - t_start) - 2.0, 1.0)
        try:
            proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        plans = read_plans(logdir)
        with open(jsonl, "a") as f:
            f.write(json.dumps({"plans": plans}, default=str) + "\n")
    write()
    print()
    with open(md_path) as f:
        print(f.read())
    print(f"[gpu_check] wrote {jsonl} and {md_path} in {time.perf_counter() - t_start:.0f} s")
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
