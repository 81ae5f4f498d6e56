"""Host cost of a sharded torchacc.compile step vs the same step unsharded (issue 40, part 7).

Runs in SPMD mode on 4 CPU devices (``CPU_NUM_DEVICES=4``, set here before JAX starts). One
model, a stack of ``--layers`` Linear+GELU layers of width ``--width`` with AdamW, trained through
``torchacc.compile(step)`` in three layouts:

- cpu: the model on the CPU (the trace-once frontend's own tensors, flat step buffers), for
  reference;
- replicated: the model on the torchacc device in SPMD mode, nothing marked (every array
  replicated over the 4 devices);
- sharded: the same with FSDPv2 (every parameter's largest dim over the 4 devices) and the batch
  split over them.

For each: the wall time of a steady step (the program waited for inside it) and the program's own
time inside the same steps (launch + XLA:CPU execution, waited for); host = step - program, what
the frontend adds per step. Medians over ``--repeats`` repeats of ``--steps`` steps. Usage:
    python benchmarks/dynamo_spmd_host_cost.py [--steps 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

_inside = [0.0]


def _timed(exe):
    def run(*args):
        start = time.perf_counter()
        out = exe(*args)
        jax.block_until_ready(out)
        _inside[0] += time.perf_counter() - start
        return out

    return run


def _model(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def measure(layout, args):
    model = _model(args.layers, args.width)
    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    dev = torch.device("cpu") if layout == "cpu" else torchacc.device()
    if layout == "sharded":
        model = FSDPv2(model, mesh)
    else:
        model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @torchacc.compile
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(args.batch, args.width).to(dev)
    y = torch.randn(args.batch, args.width).to(dev)
    if layout == "sharded":
        xs.mark_sharding(x, mesh, ("fsdp", None))
        xs.mark_sharding(y, mesh, ("fsdp", None))
    for _ in range(3):  # eager step, trace + compile, one steady step
        step(x, y)
    torchacc.sync(wait=True)
    (prog,) = step._programs.values()
    piece = prog.lowered.pieces[0]
    piece._exes = {k: _timed(e) for k, e in piece._exes.items()}
    walls, progs = [], []
    for _ in range(args.repeats):
        _inside[0] = 0.0
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step(x, y)
        if layout != "cpu":
            torchacc.sync(wait=True)
        walls.append((time.perf_counter() - start) / args.steps)
        progs.append(_inside[0] / args.steps)
    float(loss)
    wall, program = statistics.median(walls), statistics.median(progs)
    return wall, program, statistics.median([w - p for w, p in zip(walls, progs)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    xr.use_spmd()
    rows = {}
    for layout in ("cpu", "replicated", "sharded"):
        rows[layout] = measure(layout, args)
        wall, program, host = rows[layout]
        print(
            f"{layout:10} step {wall * 1e3:7.3f} ms  program {program * 1e3:7.3f} ms  "
            f"host {host * 1e3:7.3f} ms",
            flush=True,
        )
    ratio = rows["sharded"][2] / rows["replicated"][2]
    print(f"host sharded / replicated = {ratio:.3f}x")


if __name__ == "__main__":
    main()
