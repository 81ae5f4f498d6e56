"""The LLaMA gallery model trained through ``torchacc.accelerate`` on variable-length batches
(bucketing), the eager backend and the lazy device side by side.

    python -m gallery.accelerate.main --model llama-tiny --steps 20 --buckets 16,32,64
    python -m gallery.accelerate.main --model llama-1b --bf16 --gc --buckets 512,1024,2048 \\
        --max-len 2048 --batch 4 --steps 50                                # on a GPU

A synthetic SFT-like dataset: each batch has its own random length (``--min-len`` to
``--max-len``); ``accelerate()`` gets the host loader and pads each batch to its bucket (labels
with -100, ignored by the loss), so the lazy device compiles one program per bucket instead of one
per length. Both backends start from the same weights and see the same batches; the table at the
end has each backend's step time (median after the first ``--warmup`` steps), tokens/s (the
batches' real tokens, padding left out), for the lazy device the step programs' achieved TFLOP/s
per device and MFU (XLA's cost analysis, Note [Step FLOPs] in torchacc/metrics.py; MFU n/a on a
CPU unless ``--peak_tflops``; both over the steps after the warm-up, a new bucket's compile
included), programs compiled and losses. (Peak memory needs one process per backend:
benchmarks/accel_memory.py.)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchacc as ta
from gallery.llama.model import CONFIGS, build_llama
from torchacc import hardware


class CausalLM(nn.Module):
    """The gallery LLaMA with its loss: ``model(input_ids, labels)`` -> mean token loss."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, input_ids, labels):
        logits = self.llama(input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def synthetic_batches(args, vocab):
    """``args.steps`` batches of random length; next-token labels; same for both backends."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.steps):
        n = int(torch.randint(args.min_len, args.max_len + 1, (), generator=g))
        ids = torch.randint(0, vocab, (args.batch, n + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()})
    return out


def train(backend, base, batches, args):
    config = ta.Config(backend=backend)
    config.compute.bf16 = args.bf16
    config.dataloader.buckets = args.buckets
    if args.gc:
        config.memory.gc, config.memory.gc_cls = True, {"Block"}
    before = ta.metrics.counter_value("UncachedCompile") or 0
    before += ta.metrics.counter_value("PersistentCacheHit") or 0
    model, loader = ta.accelerate(copy.deepcopy(base), batches, config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times, flops = [], [], []
    tokens = [b["input_ids"].numel() for b in batches]
    start = time.perf_counter()
    flops_mark = ta.metrics.executed_flops()
    for batch in loader:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if backend == "lazy":
            ta.sync(wait=True)  # time whole steps (the loader would sync at the next batch)
        now = time.perf_counter()
        times.append(now - start)
        start = now
        executed = ta.metrics.executed_flops()  # a float: no sync (Note [Step FLOPs])
        flops.append(executed - flops_mark)
        flops_mark = executed
    losses = [float(t) for t in losses]
    timed = slice(args.warmup, None) if len(times) > args.warmup else slice(None)
    seconds = sum(times[timed])
    achieved = sum(flops[timed]) / seconds if seconds > 0 else 0.0
    programs = (ta.metrics.counter_value("UncachedCompile") or 0) + (
        ta.metrics.counter_value("PersistentCacheHit") or 0
    )
    return {
        "backend": backend,
        "step_ms": round(1000 * statistics.median(times[args.warmup :] or times), 1),
        "tokens_per_sec": round(sum(tokens[timed]) / seconds) if seconds > 0 else None,
        "tflops": achieved / 1e12 if achieved else None,
        "mfu": achieved / args.peak if achieved and args.peak else None,
        "programs": programs - before if backend == "lazy" else 0,
        "first_loss": round(losses[0], 4),
        "final_loss": round(losses[-1], 4),
        "losses": losses,
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny", choices=sorted(CONFIGS))
    p.add_argument("--backends", default="eager,lazy")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-len", type=int, default=2)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--buckets", default="16,32,64")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gc", action="store_true", help="checkpoint every decoder block")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line per backend")
    p.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s for MFU (default: from the device kind; CPU: n/a)",
    )
    args = p.parse_args(argv)
    args.buckets = [int(b) for b in args.buckets.split(",")]
    return args


def main(argv=None):
    args = parse(argv)
    args.peak = hardware.device_peak(
        ta.jax_device().device_kind, "bfloat16" if args.bf16 else "float32", args.peak_tflops
    )
    torch.manual_seed(args.seed)
    base = CausalLM(build_llama(args.model))
    batches = synthetic_batches(args, CONFIGS[args.model].vocab_size)
    results = [train(b, base, batches, args) for b in args.backends.split(",")]
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print(
            "| backend | step ms (median) | programs | tokens/s | TFLOP/s/device | MFU "
            "| first loss | final loss |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            tflops = "–" if r["tflops"] is None else f"{r['tflops']:.3g}"
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            print(
                f"| {r['backend']} | {r['step_ms']} | {r['programs']} | {r['tokens_per_sec']:,} "
                f"| {tflops} | {mfu} | {r['first_loss']} | {r['final_loss']} |"
            )
    return results


if __name__ == "__main__":
    main()
