"""Host cost of the seed recipe's training step on the compiler path vs the eager CPU step.

Host cost does not depend on tensor sizes, so this runs structure-identical *narrow* replicas of the
gallery models on tiny tensors, where an eager CPU step (1 torch thread) is nearly pure dispatch:

- ``resnet50-narrow``: ResNet-50's [3, 4, 6, 3] bottlenecks at width 4, 10 classes, 2x3x32x32;
- ``gpt2-narrow``: GPT-2's 12 blocks at d=64 (4 heads), vocab 512, 2x16 tokens.

The compiler step is the TorchAcc recipe's (seed 002): AMP O1 (bf16 autocast), forward, backward,
``xm._fetch_gradients`` + ``xm.all_reduce``, ``syncfree.AdamW``, ``zero_grad``, ``xm.mark_step()``
without waiting. ``--optimizer`` picks another optimizer for both sides (``adamw-fused`` is
``torch.optim.AdamW(fused=True)``, ``adamw-foreach`` torch's foreach path). The eager step is the
gallery's eager path on CPU: ``torch.autocast('cpu', bf16)`` and ``torch.optim.AdamW(fused=True)``
(what the gallery uses on CUDA).

Per model it reports recorded ops per step (graph nodes of the step's program), record ms (host
time before ``mark_step``), mark_step ms (host time inside it, which launches without waiting; the
executable call in it is shown apart, as on XLA:CPU it runs the program in the calling thread),
the eager step and the ratio (record + mark_step) / eager: the median over repeats of each
repeat's paired ratio, eager and compiler steps alternating so machine drift hits both alike; and
the share of measured steps launched as known steps (Note [Known steps]: no graph walk).

Usage: python benchmarks/host_cost.py [--steps 10] [--repeats 7] [--models ...] [--json out.json]
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
import torch.nn.functional as F  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.core.xla_model as xm  # noqa: E402
from gallery.gpt.model import build_gpt  # noqa: E402
from gallery.resnet50.model import ResNet  # noqa: E402
from torchacc import metrics  # noqa: E402
from torchacc.torch_xla.amp import autocast, syncfree  # noqa: E402

MODELS = ("resnet50-narrow", "gpt2-narrow")
OPTIMIZERS = ("syncfree-adamw", "adamw-fused", "adamw-foreach")


def _count(name):
    return metrics.counter_value(name) or 0


def _execute_seconds():
    data = metrics.metric_data("ExecuteTime")
    return data[1] if data else 0.0


def build(name):
    torch.manual_seed(0)
    if name == "resnet50-narrow":
        return ResNet((3, 4, 6, 3), num_classes=10, width=4)
    if name == "gpt2-narrow":
        return build_gpt("gpt2", n_embd=64, n_head=4, vocab_size=512, block_size=16)
    raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def batch(name):
    g = torch.Generator().manual_seed(0)
    if name == "resnet50-narrow":
        return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    return torch.randint(0, 512, (2, 16), generator=g), torch.randint(0, 512, (2, 16), generator=g)


def make_optimizer(kind, params, device_path):
    if kind == "syncfree-adamw" and device_path:
        return syncfree.AdamW(params, lr=1e-3)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def loss_of(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def eager_step(model, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def compiler_step(model, opt, x, y, dev):
    """The seed recipe's step; returns (record seconds, mark_step seconds)."""
    start = time.perf_counter()
    with autocast(dev, dtype=torch.bfloat16):
        loss = loss_of(model(x), y)
    loss.backward()
    gradients = xm._fetch_gradients(opt)
    xm.all_reduce("sum", gradients, scale=1.0 / xm.xrt_world_size())
    opt.step()
    opt.zero_grad(set_to_none=True)
    mid = time.perf_counter()
    xm.mark_step()
    return mid - start, time.perf_counter() - mid


def measure(name, optimizer, steps, repeats):
    dev = torchacc.device()
    eager_model = build(name)
    device_model = build(name).to(dev)
    eopt = make_optimizer(optimizer, eager_model.parameters(), False)
    dopt = make_optimizer(optimizer, device_model.parameters(), True)
    x, y = batch(name)
    xd, yd = x.to(dev), y.to(dev)
    for _ in range(3):  # compile, optimizer state
        eager_step(eager_model, eopt, x, y)
        compiler_step(device_model, dopt, xd, yd, dev)
        xm.wait_device_ops()
    compiles_before = _count("UncachedCompile") + _count("PersistentCacheHit")
    ops_before = _count("RecordedOps")
    syncs_before = _count("MarkStep")
    known_before = _count("KnownStep")
    eager_t, record_t, launch_t, exec_t, ratios = [], [], [], [], []
    for _ in range(repeats):
        e_total = r_total = l_total = 0.0
        x_start = _execute_seconds()
        for _ in range(steps):
            start = time.perf_counter()
            eager_step(eager_model, eopt, x, y)
            e_total += time.perf_counter() - start
            rec, launch = compiler_step(device_model, dopt, xd, yd, dev)
            r_total += rec
            l_total += launch
            xm.wait_device_ops()  # outside the timed region: only host cost is measured
        eager_t.append(e_total / steps)
        record_t.append(r_total / steps)
        launch_t.append(l_total / steps)
        exec_t.append((_execute_seconds() - x_start) / steps)
        ratios.append((r_total + l_total) / e_total)
    syncs = _count("MarkStep") - syncs_before
    recompiles = _count("UncachedCompile") + _count("PersistentCacheHit") - compiles_before
    return {
        "model": name,
        "optimizer": optimizer,
        "params": sum(1 for _ in device_model.parameters()),
        "recorded_ops_per_step": (_count("RecordedOps") - ops_before) / syncs,
        "eager_step_ms": statistics.median(eager_t) * 1e3,
        "record_ms": statistics.median(record_t) * 1e3,
        "mark_step_ms": statistics.median(launch_t) * 1e3,
        # the executable call inside mark_step: on XLA:CPU it runs (part of) the program in the
        # calling thread, so it is device time here, not host cost; on a GPU it only enqueues
        "execute_call_ms": statistics.median(exec_t) * 1e3,
        "ratio": statistics.median(ratios),
        "repeat_ratios": ratios,
        "recompiles_after_warmup": recompiles,
        # steps launched without a graph walk (Note [Known steps])
        "known_step_fraction": (_count("KnownStep") - known_before) / syncs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizer", default="syncfree-adamw", choices=OPTIMIZERS)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(m, args.optimizer, args.steps, args.repeats) for m in args.models.split(",")]
    print(
        "| model | optimizer | params | recorded ops/step | record ms | "
        "mark_step ms (executable call) | eager CPU step ms | ratio (record+mark_step)/eager | "
        "known steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['optimizer']} | {r['params']} | "
            f"{r['recorded_ops_per_step']:.0f} | {r['record_ms']:.2f} | {r['mark_step_ms']:.2f} "
            f"({r['execute_call_ms']:.2f}) | "
            f"{r['eager_step_ms']:.2f} | {r['ratio']:.2f} | {r['known_step_fraction']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
