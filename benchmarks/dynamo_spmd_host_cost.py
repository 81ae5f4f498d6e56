"""Host cost of a sharded step vs the same step unsharded on the trace-once frontend (issue 40, 7).

Runs in SPMD mode on 4 CPU devices (``CPU_NUM_DEVICES=4``, set here before JAX starts). One
model, a stack of ``--layers`` Linear+GELU layers of width ``--width`` with AdamW, in two layouts:

- replicated: the model on the torchacc device in SPMD mode, nothing marked (every array
  replicated over the 4 devices);
- sharded: the same with FSDPv2 (every parameter's largest dim over the 4 devices) and the batch
  split over them;

and through two doors of the trace-once frontend:

- ``compile``: ``torchacc.compile(step)``, the whole step (forward, backward, AdamW) one program;
- ``torch.compile``: ``torch.compile(model, backend="torchacc")`` (a forward and a backward
  program), the loss, ``backward()`` and AdamW around it on the lazy frontend, one
  ``torchacc.sync()`` per step.

The box is shared, so time is CPU time, not wall time, and the layouts are interleaved: each
repeat runs ``--steps`` steps of every (door, layout) in turn (the order alternating between
repeats). Per step: thread = the main thread's CPU time (``time.thread_time``: Python, tracing,
dispatch, launches, and whatever XLA:CPU runs on the calling thread); in-call = the part of it
spent inside program calls (the trace-once programs and the lazy frontend's launches); host =
thread - in-call, what the frontend itself costs; process = the whole process's CPU time
(programs on every thread included). Medians over ``--repeats``; the ratios are medians of the
per-repeat ratios sharded / replicated. Usage:
    python benchmarks/dynamo_spmd_host_cost.py [--steps 20] [--repeats 9]
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc import metrics  # noqa: E402
from torchacc.dynamo import aot  # noqa: E402
from torchacc.engine import execute  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

DOORS = ("compile", "torch.compile")
LAYOUTS = ("replicated", "sharded")


_inside = [0.0]  # main-thread CPU seconds spent inside program calls


def _timed(fn):
    def call(*args):
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            _inside[0] += time.thread_time() - start

    call.timed = True
    return call


def _time_programs(steps):
    """Wrap every program call: the trace-once frontend's executables and the lazy launches."""
    if not getattr(execute._launch, "timed", False):
        execute._launch = _timed(execute._launch)
    lowered = list(aot._lowered.values())
    lowered += [p.lowered for s in steps for p in getattr(s, "programs", {}).values()]
    for low in lowered:
        for piece in low.pieces:
            exes = getattr(piece, "_exes", {})
            for k, exe in exes.items():
                if not getattr(exe, "timed", False):
                    exes[k] = _timed(exe)


def _model(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def build(door, layout, args):
    """A step function of no arguments (its batch bound) for ``door`` in ``layout``, warmed up."""
    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    model = _model(args.layers, args.width)
    dev = torchacc.device()
    model = FSDPv2(model, mesh) if layout == "sharded" else model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width).to(dev)
    y = torch.randn(args.batch, args.width).to(dev)
    if layout == "sharded":
        xs.mark_sharding(x, mesh, ("fsdp", None))
        xs.mark_sharding(y, mesh, ("fsdp", None))

    if door == "compile":

        @torchacc.compile
        def compiled(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        def step():
            return compiled(x, y)

        step.programs = compiled._programs

    else:
        cm = torch.compile(model, backend="torchacc")

        def step():
            loss = F.mse_loss(cm(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torchacc.sync()
            return loss

    for _ in range(4):  # eager/trace/compile steps, then steady ones
        step()
    torchacc.sync(wait=True)
    return step


def run_block(step, steps):
    """(thread, in-call, process) CPU seconds per step over ``steps`` steps, programs waited for."""
    _inside[0] = 0.0
    t0, p0 = time.thread_time(), time.process_time()
    for _ in range(steps):
        loss = step()
    torchacc.sync(wait=True)
    float(loss.detach())
    thread, process = time.thread_time() - t0, time.process_time() - p0
    return thread / steps, _inside[0] / steps, process / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--doors", nargs="*", default=list(DOORS), choices=DOORS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    xr.use_spmd()
    steps = {(d, lay): build(d, lay, args) for d in args.doors for lay in LAYOUTS}
    _time_programs(steps.values())
    compiles = metrics.counter_value("DynamoCompile")
    cells = {k: [] for k in steps}
    order = list(steps)
    for r in range(args.repeats):
        for key in order if r % 2 == 0 else reversed(order):
            cells[key].append(run_block(steps[key], args.steps))
    assert metrics.counter_value("DynamoCompile") == compiles, "a timed step compiled"
    med = statistics.median
    for door in args.doors:
        rep, shd = cells[(door, "replicated")], cells[(door, "sharded")]
        for layout, rows in (("replicated", rep), ("sharded", shd)):
            thread, inside, proc = (med(r[i] for r in rows) for i in range(3))
            host = med(r[0] - r[1] for r in rows)
            print(
                f"{door:14} {layout:10} host {host * 1e3:7.3f} ms  thread {thread * 1e3:7.3f} ms"
                f"  in-call {inside * 1e3:7.3f} ms  process {proc * 1e3:7.3f} ms"
            )
        host = med((s[0] - s[1]) / (r[0] - r[1]) for s, r in zip(shd, rep))
        thread = med(s[0] / r[0] for s, r in zip(shd, rep))
        proc = med(s[2] / r[2] for s, r in zip(shd, rep))
        print(
            f"{door:14} sharded / replicated: host {host:.3f}x  thread {thread:.3f}x  "
            f"process {proc:.3f}x"
        )


if __name__ == "__main__":
    main()
