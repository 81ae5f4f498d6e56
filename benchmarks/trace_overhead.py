"""Host cost of recording a training step, compared with running it eagerly on CPU.

For a ResNet-like and a GPT-like model on tiny inputs (so eager CPU time is almost pure dispatch
cost, with ``torch.set_num_threads(1)``) this measures:

- traced: host time of forward + backward + optimizer on the torchacc device, before ``sync()``;
- eager: the same step eagerly on CPU;
- ops: ATen ops one eager step dispatches (counted with a TorchDispatchMode);
- us/op = traced / ops, and the ratio traced / eager (target <= 2.0, long-term <= 1.0): the median
  over repeats of each repeat's traced / eager time, with eager and traced steps alternating.

Usage: python benchmarks/trace_overhead.py [--steps 20] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torchacc  # noqa: E402


class ResNetLike(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
            )
            for _ in range(4)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


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
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTLike(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, layers=4, seq=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _batch(name):
    g = torch.Generator().manual_seed(0)
    if name == "resnet":
        return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)
    idx = torch.randint(0, 64, (2, 16), generator=g)
    return idx, torch.randint(0, 64, (2 * 16,), generator=g)


def _step(model, opt, x, y):
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


class _Count(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure(name, steps, repeats):
    torch.manual_seed(0)
    eager = ResNetLike() if name == "resnet" else GPTLike()
    traced = copy.deepcopy(eager).to(torchacc.device())
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    topt = torch.optim.AdamW(traced.parameters(), lr=1e-3)
    x, y = _batch(name)
    xd, yd = x.to(torchacc.device()), y.to(torchacc.device())
    for _ in range(3):  # warm-up: compile, optimizer state
        _step(eager, eopt, x, y)
        _step(traced, topt, xd, yd)
        torchacc.sync(wait=True)
    with _Count() as counter:
        _step(eager, eopt, x, y)
    eager_t, traced_t, ratios = [], [], []
    for _ in range(repeats):
        # eager and traced steps alternate, and each repeat's ratio pairs the two measured side by
        # side, so drift in the machine's speed (shared CPU) hits both alike
        eager_total = traced_total = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            _step(eager, eopt, x, y)
            eager_total += time.perf_counter() - start
            start = time.perf_counter()
            _step(traced, topt, xd, yd)
            traced_total += time.perf_counter() - start
            torchacc.sync(wait=True)
        eager_t.append(eager_total / steps)
        traced_t.append(traced_total / steps)
        ratios.append(traced_total / eager_total)
    e, t = statistics.median(eager_t), statistics.median(traced_t)
    return {
        "model": name,
        "ops_per_step": counter.n,
        "eager_step_ms": e * 1e3,
        "traced_step_ms": t * 1e3,
        "us_per_op": t / counter.n * 1e6,
        "ratio": statistics.median(ratios),
        "repeat_ratios": ratios,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="resnet,gpt")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(m, args.steps, args.repeats) for m in args.models.split(",")]
    print("| model | ATen ops/step | eager CPU step (ms) | traced host step (ms) | us/op | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['ops_per_step']} | {r['eager_step_ms']:.2f} | "
            f"{r['traced_step_ms']:.2f} | {r['us_per_op']:.1f} | {r['ratio']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
