#!/usr/bin/env python
"""What ``--tensorboard DIR`` costs a training run: the same run with and without it, side by side.

    python benchmarks/observe_overhead.py --repeats 7 --json out.json

Each repeat runs the launcher twice in place (``benchmarks/_worker.py``, one process; the order of
the pair alternates between repeats so that drift hits both alike), once plain and once with
``--tensorboard``, and reads from each: the steady step time of the ``[summary]`` (warm-up
excluded), the median of its steady per-step times (robust to a load spike on a shared box), the
``TransferFromDevice`` counter (device reads) and the losses. Reported: the median over repeats of
each pair's ratio (with / without) for both step times, their min and max, and whether the device
reads and the losses were identical in every pair. Then, in this process, the host time of what
``--tensorboard`` adds at each progress line (``RunBoard.losses`` + ``RunBoard.interval`` for
``--log_interval`` losses), median of many calls, as a share of the plain run's step time. The
target is within 2% and no extra ``TransferFromDevice`` (Note [Observing without syncs] in
gallery/common/observe.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_worker.py")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--sizes", default="--batch_size 8 --seq_len 64", help="launcher size flags")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--eager", action="store_true", help="the eager path instead of --compiler-opt")
    p.add_argument("--json", default=None, help="also write the rows and summary here")
    return p.parse_args(argv)


def run_once(args, tmp: str, tag: str, tensorboard: bool) -> dict:
    out, metrics = os.path.join(tmp, tag + ".json"), os.path.join(tmp, tag + ".metrics.json")
    flags = [
        f"--model={args.model}",
        *args.sizes.split(),
        f"--max_steps={args.steps}",
        f"--warmup_steps={args.warmup}",
        f"--log_interval={args.log_interval}",
        "--amp_level=O0",
        f"--output={out}",
    ]
    if not args.eager:
        flags.append("--compiler-opt")
    if tensorboard:
        flags.append(f"--tensorboard={os.path.join(tmp, tag + '.tb')}")
    env = dict(os.environ, TORCHACC_CACHE_DIR="off")
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, WORKER, metrics, "--", *flags]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    with open(metrics) as f:
        counters = (json.load(f).get("torchacc") or {}).get("counters", {})
    steady = result["step_times"][args.warmup :]
    return {
        "tensorboard": tensorboard,
        "step_ms": result["summary"]["steady_step_time_s"] * 1000.0,
        "step_ms_median": statistics.median(steady) * 1000.0,
        "transfers_from_device": counters.get("TransferFromDevice"),
        "losses": result["losses"],
        "command": " ".join(["python", *cmd[1:]]),
    }


def write_cost_ms(log_interval: int, calls: int = 300) -> float:
    """Median host milliseconds of one progress line's TensorBoard writes (in this process)."""
    sys.path.insert(0, ROOT)
    from gallery.common.observe import RunBoard

    with tempfile.TemporaryDirectory(prefix="observe-writes-") as tmp:
        board = RunBoard(tmp, {"model": "gpt-tiny", "batch_size": 8})
        steps, losses, times = [], [], []
        for i in range(calls):
            steps += range(i * log_interval, (i + 1) * log_interval)
            losses += [6.0 - 1e-3 * j for j in range(log_interval)]
            t0 = time.perf_counter()
            board.losses(steps, losses)
            board.interval(
                len(steps),
                samples_per_sec=400.0,
                step_time_s=0.02,
                lr=6e-4,
                peak_mem_gib=0.8,
                mem_source="host_rss",
                compiles=2,
            )
            times.append(time.perf_counter() - t0)
        board.close()
    return statistics.median(times) * 1000.0


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, ratios, median_ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="observe-overhead-") as tmp:
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            pair = {tb: run_once(args, tmp, f"r{r}.{'tb' if tb else 'plain'}", tb) for tb in order}
            ratio = pair[True]["step_ms"] / pair[False]["step_ms"]
            ratios.append(ratio)
            median_ratios.append(pair[True]["step_ms_median"] / pair[False]["step_ms_median"])
            rows += [pair[False], pair[True]]
            print(
                f"[observe] repeat {r + 1}/{args.repeats}: plain {pair[False]['step_ms']:.2f} "
                f"ms/step (median step {pair[False]['step_ms_median']:.2f}), --tensorboard "
                f"{pair[True]['step_ms']:.2f} ms/step (median step "
                f"{pair[True]['step_ms_median']:.2f}), ratio {ratio:.4f} (medians "
                f"{median_ratios[-1]:.4f}), load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    plain = [row for row in rows if not row["tensorboard"]]
    tb = [row for row in rows if row["tensorboard"]]
    summary = {
        "model": args.model,
        "path": "eager" if args.eager else "compiler (--compiler-opt)",
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup": args.warmup,
        "log_interval": args.log_interval,
        "plain_step_ms_median": statistics.median(r["step_ms"] for r in plain),
        "tensorboard_step_ms_median": statistics.median(r["step_ms"] for r in tb),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "plain_median_step_ms_median": statistics.median(r["step_ms_median"] for r in plain),
        "tensorboard_median_step_ms_median": statistics.median(r["step_ms_median"] for r in tb),
        "median_step_ratio_median": statistics.median(median_ratios),
        "median_step_ratio_min": min(median_ratios),
        "median_step_ratio_max": max(median_ratios),
        "same_transfers": all(
            a["transfers_from_device"] == b["transfers_from_device"] for a, b in zip(plain, tb)
        ),
        "transfers_from_device": sorted({r["transfers_from_device"] for r in rows}, key=str),
        "same_losses": all(a["losses"] == b["losses"] for a, b in zip(plain, tb)),
    }
    cost = write_cost_ms(args.log_interval)
    summary["writes_ms_per_log_line"] = cost
    summary["writes_share_of_plain_step"] = (
        cost / args.log_interval / summary["plain_median_step_ms_median"]
    )
    print(json.dumps(summary, indent=1))
    if args.json:
        for row in rows:
            row.pop("losses")
        with open(args.json, "w") as f:
            payload = {"summary": summary, "ratios": ratios, "median_ratios": median_ratios}
            json.dump({**payload, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
