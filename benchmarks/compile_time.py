"""Compile time against depth: the first training step of GPT-shaped models, unrolled or scanned.

For each depth and mode a fresh process (an empty persistent compilation cache of its own) builds
a GPT of the gallery (``gallery/gpt/model.py``, ``build_gpt(..., scan_layers=...)``) at a small
width, then times on the torchacc device:

- first: the first training step (forward, backward, ``torch.optim.AdamW``, ``sync`` and the
  wait for its results): recording, XLA compile and one run; wall seconds and the process's CPU
  seconds (all threads, compile threads included);
- fwdbwd: the same for forward + backward alone (no optimizer), in a process of its own; the
  gradients are zeroed before each step, so they are the step's results (zeroed after
  ``backward`` they would be dropped unread and XLA would remove the backward);
- steady: the median wall time of the later steps (``--steps`` in all).

``--batched-updates 0`` turns off the batched optimizer update (Note [Batched optimizer updates]
in torchacc/lowering/batching.py) to show what it changes.

Usage: python benchmarks/compile_time.py [--depths 4 12 24 48] [--repeats 3] [--json out.json]
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def worker(args):
    sys.path.insert(0, ROOT)
    import torch
    import torch._dynamo  # noqa: F401  (AdamW imports it; fwdbwd would pay it in its first step)

    import torchacc
    from gallery.gpt.model import build_gpt

    torch.manual_seed(0)
    dev = torch.device("torchacc")
    model = build_gpt(
        "gpt-mini",
        scan_layers=args.mode == "scan",
        n_layer=args.depth,
        n_embd=args.width,
        n_head=args.width // 64,
        vocab_size=4096,
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if args.what == "step" else None
    g = torch.Generator().manual_seed(1)
    times, cpu_first = [], None
    for step in range(args.steps):
        idx = torch.randint(0, 4096, (args.batch, args.seq), generator=g).to(dev)
        start, cpu = time.perf_counter(), time.process_time()
        if opt is None:  # before the step: its gradients are results, so the backward runs
            model.zero_grad()
        loss = model(idx).float().square().mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        torchacc.sync()
        float(loss.item())  # wait for the step's results
        times.append(time.perf_counter() - start)
        if step == 0:
            cpu_first = time.process_time() - cpu
    print(json.dumps({"first": times[0], "first_cpu": cpu_first, "steady": times[1:]}))


def run_one(depth, mode, what, args):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHACC_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
        env["TORCHACC_BATCHED_UPDATES"] = str(args.batched_updates)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, __file__, "--worker", f"--depth={depth}", f"--mode={mode}"]
        cmd += [f"--what={what}", f"--steps={args.steps}", f"--width={args.width}"]
        cmd += [f"--seq={args.seq}", f"--batch={args.batch}"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            raise SystemExit(f"{cmd} failed:\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depths", type=int, nargs="+", default=[4, 12, 24, 48])
    p.add_argument("--modes", nargs="+", default=["loop", "scan"])
    p.add_argument("--what", nargs="+", default=["step", "fwdbwd"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--batched-updates", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--depth", type=int)
    p.add_argument("--mode")
    args = p.parse_args()
    if args.worker:
        args.what = args.what[0] if isinstance(args.what, list) else args.what
        return worker(args)
    rows = []
    print("what    depth  mode  first_s  first_cpu_s  steady_s  (medians of", args.repeats, "runs)")
    for what in args.what:
        for depth in args.depths:
            for mode in args.modes:
                runs = [run_one(depth, mode, what, args) for _ in range(args.repeats)]
                row = {
                    "what": what,
                    "depth": depth,
                    "mode": mode,
                    "first": statistics.median(r["first"] for r in runs),
                    "first_cpu": statistics.median(r["first_cpu"] for r in runs),
                    "steady": statistics.median(t for r in runs for t in r["steady"][1:]),
                    "runs": runs,
                }
                rows.append(row)
                print(
                    f"{what:7s} {depth:5d}  {mode:4s}  {row['first']:7.2f}  "
                    f"{row['first_cpu']:11.2f}  {row['steady']:8.3f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
