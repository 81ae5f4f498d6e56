"""Horovod API vs torch DDP on the eager path: the step time of gallery/horovod/train.py as 2
ranks (torchaccrun), ``hvd.DistributedOptimizer`` against ``--ddp``, run alternately.

    python benchmarks/hvd_vs_ddp.py --repeats 3 --steps 40

Prints each run's median step time (second half of the steps) and the median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode, steps, batch, nproc):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [
            sys.executable,
            "-m",
            "torchacc.horovod.run",
            "-np",
            str(nproc),
            sys.executable,
            "-m",
            "gallery.horovod.train",
            "--max-steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--samples",
            str(steps * batch * nproc),
            "--output",
            out,
        ]
        if mode == "ddp":
            cmd.append("--ddp")
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=REPO)
        with open(out) as f:
            return json.load(f)["median_step_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    times = {"hvd": [], "ddp": []}
    for _ in range(args.repeats):
        for mode in ("hvd", "ddp"):
            times[mode].append(run(mode, args.steps, args.batch, args.nproc))
            print(f"{mode}: {times[mode][-1] * 1e3:.2f} ms/step", flush=True)
    hvd, ddp = (statistics.median(times[m]) for m in ("hvd", "ddp"))
    print(
        f"median over {args.repeats}: hvd {hvd * 1e3:.2f} ms, ddp {ddp * 1e3:.2f} ms, "
        f"ratio {hvd / ddp:.3f}"
    )


if __name__ == "__main__":
    main()
