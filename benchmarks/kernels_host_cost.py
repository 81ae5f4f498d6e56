"""Recorded ops and host time per training step with and without ``torchacc_ops`` (--kernel-opt).

Runs the gallery's llama-tiny and gpt-tiny (2 x 16 tokens) on the compiler path: AMP O1 (bf16
autocast), forward, loss, backward, ``syncfree.AdamW``, ``xm.mark_step()``; the same weights with
``kernels=False`` (plain PyTorch layers, ``F.cross_entropy``) and ``kernels=True``
(``torchacc_ops``). Per variant: recorded ops per step (graph nodes of the step's program) and the
median host ms before ``mark_step`` (recording) and inside it. On the CPU this measures host cost,
not kernels: device-time speedups need a GPU.

Usage: python benchmarks/kernels_host_cost.py [--steps 10] [--repeats 3] [--models ...]
[--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.core.xla_model as xm  # noqa: E402
from gallery.gpt.main import lm_loss_fn  # noqa: E402
from gallery.gpt.model import build_gpt  # noqa: E402
from gallery.llama.model import build_llama  # noqa: E402
from torchacc import metrics  # noqa: E402
from torchacc.torch_xla.amp import autocast, syncfree  # noqa: E402

BUILDERS = {"llama-tiny": build_llama, "gpt-tiny": build_gpt}


def _run(name, kernels, steps, repeats):
    torch.manual_seed(0)
    device = torchacc.device()
    model = BUILDERS[name](name, kernels=kernels).to(device)
    opt = syncfree.AdamW(model.parameters(), lr=1e-4)
    loss_fn = lm_loss_fn(kernels)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 512, (2, 16), generator=g).to(device)
    tgt = torch.randint(0, 512, (2, 16), generator=g).to(device)

    def step():
        with autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(model(idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        xm.mark_step()
        return t0

    for _ in range(3):  # compile, then settle
        step()
    xm.wait_device_ops()
    record, sync = [], []
    for _ in range(repeats):
        metrics.clear_all()
        for _ in range(steps):
            start = time.perf_counter()
            t0 = step()
            end = time.perf_counter()
            record.append((t0 - start) * 1e3)
            sync.append((end - t0) * 1e3)
        xm.wait_device_ops()
    ops = metrics.counter_value("RecordedOps") // steps
    compiles = metrics.counter_value("UncachedCompile") or 0
    return {
        "ops_per_step": ops,
        "record_ms": statistics.median(record),
        "mark_step_ms": statistics.median(sync),
        "compiles_after_warmup": compiles,
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=sorted(BUILDERS), default=list(BUILDERS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    print(f"{'model':<12} {'kernels':<13} {'ops/step':>8} {'record ms':>10} {'mark_step ms':>13}")
    for name in args.models:
        for kernels in (False, True):
            r = _run(name, kernels, args.steps, args.repeats)
            results[f"{name}/{'torchacc_ops' if kernels else 'plain'}"] = r
            label = "torchacc_ops" if kernels else "plain"
            print(
                f"{name:<12} {label:<13} {r['ops_per_step']:>8} {r['record_ms']:>10.1f} "
                f"{r['mark_step_ms']:>13.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
