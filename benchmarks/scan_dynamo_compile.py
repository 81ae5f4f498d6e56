"""First-step cost against depth on the trace-once frontend: the gallery GPT with its blocks
unrolled (``loop``) or as ``ScannedLayers`` (``scan``, torch's scan operator lowered as one
lax.scan: Note [Scan on the trace-once frontend] in torchacc/lazy/scan.py).

Each (frontend, mode, depth, repeat) runs in a fresh process with the persistent compilation cache
off, and reports the process CPU seconds (all threads, XLA's compile included) and wall seconds of
the first call: ``compile``: ``torch.compile(model, backend="torchacc")`` forward + backward;
``step``: ``torchacc.dynamo.compile_step`` of a whole AdamW step (its first call traces; one eager
call comes before it, not timed).

``--steady N``: the steady call instead, scan and loop side by side in one process (the two
models built, compiled and warmed up, then their calls alternated N times so both see the same
load): median wall and process-CPU milliseconds per call of each, one process per (frontend,
depth).

Usage: python benchmarks/scan_dynamo_compile.py [--depths 2 8 24] [--repeats 3] [--steady N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _runner(frontend, mode, depth):
    """A zero-argument callable running one step of ``mode``'s model (its first call traces)."""
    import torch

    import torchacc.dynamo
    from gallery.gpt.model import build_gpt

    torch.manual_seed(0)
    model = build_gpt(
        "gpt-mini",
        scan_layers=mode == "scan",
        n_layer=depth,
        n_embd=128,
        n_head=4,
        vocab_size=1024,
        block_size=64,
        dropout=0.0,
    )
    idx = torch.randint(0, 1024, (2, 64))

    def loss_of(m, idx=idx):
        logits = m(idx)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 1024), idx.reshape(-1))

    if frontend == "compile":
        compiled = torch.compile(model, backend="torchacc")

        def run():
            model.zero_grad(set_to_none=True)
            loss_of(compiled).backward()

    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        @torchacc.dynamo.compile_step
        def step(idx):
            opt.zero_grad()
            loss = loss_of(model, idx)
            loss.backward()
            opt.step()
            return loss

        step(idx)  # eager: creates the optimizer's state
        run = lambda: step(idx)  # noqa: E731
    return run


def worker(frontend, mode, depth):
    sys.path.insert(0, ROOT)
    run = _runner(frontend, mode, depth)
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}))


def steady_worker(frontend, depth, calls):
    sys.path.insert(0, ROOT)
    runs = {mode: _runner(frontend, mode, depth) for mode in ("scan", "loop")}
    for run in runs.values():
        for _ in range(3):  # trace, compile, warm up
            run()
    times = {mode: ([], []) for mode in runs}
    for _ in range(calls):
        for mode, run in runs.items():
            cpu, wall = time.process_time(), time.perf_counter()
            run()
            times[mode][0].append(time.perf_counter() - wall)
            times[mode][1].append(time.process_time() - cpu)
    out = {
        m: [1e3 * statistics.median(w), 1e3 * statistics.median(c)] for m, (w, c) in times.items()
    }
    print(json.dumps({**out, "load": os.getloadavg()[0]}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", type=int, nargs="+", default=[2, 8, 24])
    p.add_argument("--frontends", nargs="+", default=["compile", "step"])
    p.add_argument("--modes", nargs="+", default=["scan", "loop"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steady", type=int, default=0, metavar="N")
    p.add_argument("--worker", nargs=3)
    p.add_argument("--steady-worker", nargs=3)
    args = p.parse_args()
    if args.worker:
        frontend, mode, depth = args.worker
        return worker(frontend, mode, int(depth))
    if args.steady_worker:
        frontend, depth, calls = args.steady_worker
        return steady_worker(frontend, int(depth), int(calls))
    env = {**os.environ, "TORCHACC_CACHE_DIR": "off", "PYTHONPATH": ROOT}
    if args.steady:
        return steady(args, env)
    print("| frontend | mode | depth | first call CPU s (median) | wall s (median) | CPU s runs |")
    print("|---|---|---|---|---|---|")
    for frontend in args.frontends:
        for mode in args.modes:
            for depth in args.depths:
                runs = []
                for _ in range(args.repeats):
                    cmd = [sys.executable, __file__, "--worker", frontend, mode, str(depth)]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                cpu = statistics.median(r["cpu"] for r in runs)
                wall = statistics.median(r["wall"] for r in runs)
                each = ", ".join(f"{r['cpu']:.2f}" for r in runs)
                print(f"| {frontend} | {mode} | {depth} | {cpu:.2f} | {wall:.2f} | {each} |")
                sys.stdout.flush()


def steady(args, env):
    print(
        "| frontend | depth | scan wall ms | loop wall ms | scan/loop | scan CPU ms | loop CPU ms "
        "| load |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for frontend in args.frontends:
        for depth in args.depths:
            cmd = [sys.executable, __file__, "--steady-worker", frontend, str(depth)]
            out = subprocess.run(
                [*cmd, str(args.steady)], env=env, capture_output=True, text=True, check=True
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            (sw, sc), (lw, lc) = r["scan"], r["loop"]
            print(
                f"| {frontend} | {depth} | {sw:.1f} | {lw:.1f} | {sw / lw:.2f} | {sc:.1f} | "
                f"{lc:.1f} | {r['load']:.1f} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
