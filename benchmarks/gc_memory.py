"""Gradient checkpointing's memory on the lazy device: the compiled step's temp bytes
(``memory_analysis()``) and step time with and without ``Config.memory.gc``.

    python benchmarks/gc_memory.py --layers 6 --d 256 --seq 256 --batch 4 --steps 6 --repeats 3

A GPT block stack (LayerNorm, causal attention, MLP) trained through ``torchacc.accelerate`` with
AdamW; ``gc_cls={'Block'}`` checkpoints every block. Prints one JSON line per configuration: the
last compiled step program's temp/argument/output bytes, the median step time after warm-up
(``ta.sync(wait=True)`` per step) and the final loss (equal with and without gc).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchacc as ta
from torchacc.program import cache


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, layers, d, vocab=512, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        logits = self.head(self.blocks(self.emb(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def run(gc, args):
    cache.clear_memory_cache()  # the last program built below is then this run's step
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(args.steps):
        ids = torch.randint(0, 512, (args.batch, args.seq), generator=g)
        data.append({"input_ids": ids, "labels": ids.roll(-1, 1)})
    config = ta.Config()
    if gc:
        config.memory.gc, config.memory.gc_cls = True, {"Block"}
    model, loader = ta.accelerate(Stack(args.layers, args.d), data, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, loss = [], None
    start = time.perf_counter()
    for batch in loader:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ta.sync(wait=True)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    stats = list(cache._cache.values())[-1].memory_analysis()
    return {
        "gc": gc,
        "temp_MiB": round(stats.temp_size_in_bytes / 2**20, 1),
        "argument_MiB": round(stats.argument_size_in_bytes / 2**20, 1),
        "output_MiB": round(stats.output_size_in_bytes / 2**20, 1),
        "step_ms": round(1000 * statistics.median(times[3:]), 1),
        "loss": loss.item(),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    for _ in range(args.repeats):
        for gc in (False, True):
            print(json.dumps(run(gc, args)), flush=True)


if __name__ == "__main__":
    main()
