"""How long ``python -m torchacc.plan`` takes at scale, and its plans for published setups.

    python benchmarks/plan_scale.py --what scale --repeats 3    # wall time and worker peak RSS
    python benchmarks/plan_scale.py --what anchors              # torchtitan / MaxText setups

``scale``: llama-7b on 64 virtual devices (fsdp=64) and llama-70b on 256 (fsdp=32 x tp=8,
scan_layers, gc), each a fresh ``python -m torchacc.plan`` process; prints the wall time and the
worker's peak RSS (``host_peak_bytes``). ``anchors``: the plans of torchtitan's Llama-3.1-8B on
8 x H100 (FSDP, seq 8192, local batch 2; published 6,667 tokens/s/GPU with torch.compile) and
MaxText's Llama-2-7B on 8 x H100 (FSDP 8, seq 4096; ~11,360 tokens/s/GPU), beside those figures.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCALE = {
    "llama-7b/64": [
        "--model", "llama-7b", "--batch_size", "64", "--seq_len", "4096", "--mesh", "fsdp=64",
        "--device", "h100-sxm", "--memory", "80GiB",
    ],
    "llama-70b/256": [
        "--model", "llama-70b", "--batch_size", "64", "--seq_len", "4096", "--mesh",
        "fsdp=32,tp=8", "--scan-layers", "--gc", "--device", "h100-sxm", "--memory", "80GiB",
    ],
}  # fmt: skip

ANCHORS = [
    # (label, published tokens/s/GPU, plan kwargs)
    ("torchtitan Llama-3.1-8B, 8xH100 FSDP, seq 8192, local batch 2", 6667,
     dict(model="llama3-8b", batch_size=16, seq_len=8192, mesh="fsdp=8", gc=True)),
    ("torchtitan Llama-3.1-8B (no gc)", 6667,
     dict(model="llama3-8b", batch_size=16, seq_len=8192, mesh="fsdp=8", gc=False)),
    ("MaxText Llama-2-7B, 8xH100 FSDP8, seq 4096, per-device batch 4", 11360,
     dict(model="llama-7b", batch_size=32, seq_len=4096, mesh="fsdp=8", gc=True)),
    ("MaxText Llama-2-7B (no gc)", 11360,
     dict(model="llama-7b", batch_size=32, seq_len=4096, mesh="fsdp=8", gc=False)),
]  # fmt: skip


def scale(repeats):
    env = dict(os.environ, PYTHONPATH=REPO)
    for name, args in SCALE.items():
        times, rss, plan = [], [], None
        for _ in range(repeats):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                start = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "torchacc.plan", *args, "--json", f.name],
                    env=env, capture_output=True, text=True, cwd=REPO,
                )  # fmt: skip
                times.append(time.perf_counter() - start)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(1)
                plan = json.load(open(f.name))[0]
                rss.append(plan["host_peak_bytes"])
        print(
            json.dumps(
                {
                    "setup": name,
                    "wall_s": [round(t, 1) for t in times],
                    "median_s": round(statistics.median(times), 1),
                    "worker_peak_rss_gib": round(max(rss) / 2**30, 2),
                    "total_gib": round(plan["total"] / 2**30, 2),
                    "fits": plan["fits"],
                    "step_time_s": round(plan["step_time"], 3),
                    "mfu": round(plan["mfu"], 3),
                }
            ),
            flush=True,
        )


def anchors():
    import torchacc.plan as tp

    jobs = [dict(kw, precision="bf16", optimizer="adamw", memory="80GiB") for _, _, kw in ANCHORS]
    plans = tp.plan_batch(jobs, devices=8, device="h100-sxm")
    for (label, published, _), p in zip(ANCHORS, plans):
        print(
            json.dumps(
                {
                    "setup": label,
                    "published_tok_s_gpu": published,
                    "plan_tok_s_gpu": round(p.tokens_per_s_per_device),
                    "plan_over_published": round(p.tokens_per_s_per_device / published, 2),
                    "plan_mfu": round(p.mfu, 3),
                    "compute_ms": round(p.compute_time * 1e3),
                    "hbm_ms": round(p.memory_time * 1e3),
                    "comm_ms": round(sum(p.collective_time.values()) * 1e3),
                    "total_gib": round(p.total / 2**30, 1),
                    "activations_gib": round(p.activations / 2**30, 1),
                    "fits_80GiB": p.fits,
                }
            ),
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("scale", "anchors"), required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    scale(args.repeats) if args.what == "scale" else anchors()


if __name__ == "__main__":
    main()
