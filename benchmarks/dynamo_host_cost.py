"""Host cost of a steady trace-once step (torchacc.dynamo) vs the eager CPU step.

Narrow replicas keep the real topology (ResNet-50: 53 convolutions with BatchNorm in [3, 4, 6, 3]
bottlenecks; GPT-2: 12 pre-LN blocks) at tiny widths, so an eager CPU step is almost pure
dispatch cost (``torch.set_num_threads(1)``). For each model and mode this prints/records:

- eager: wall time of an eager CPU step (forward, backward, AdamW);
- step: wall time of a steady call of the compiled step (``compile_step``: one program) or of
  the ``torch.compile(backend="torchacc")`` module with an eager AdamW;
- program: the time of the compiled program(s) alone (launch + XLA:CPU execution, measured by
  calling the executables directly on the same inputs);
- host = step - program: what the trace-once frontend adds per step (the issue's target:
  host <= 0.1x eager);
- host in-step (``compile_step`` only): step wall time minus the time spent inside the program
  call (launch + execution, waited for) *within the same steps*. On a loaded machine the
  separate-loop ``host`` above swings by milliseconds between loops; this one does not.

Medians over ``--repeats`` repeats of ``--steps`` steps. Usage:
    python benchmarks/dynamo_host_cost.py [--steps 20] [--repeats 5] [--json out.json]
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

import jax  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchacc.dynamo  # noqa: E402
from torchacc.dynamo import lower  # noqa: E402


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.c1 = nn.Conv2d(cin, width, 1, bias=False)
        self.b1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.b2 = nn.BatchNorm2d(width)
        self.c3 = nn.Conv2d(width, cout, 1, bias=False)
        self.b3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class NarrowResNet50(nn.Module):
    """ResNet-50's topology ([3, 4, 6, 3] bottlenecks, 53 conv+BN) at base width ``w``."""

    def __init__(self, w=4, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w))
        layers, cin = [], w
        for i, n in enumerate((3, 4, 6, 3)):
            width = w * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        x = self.layers(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class NarrowGPT2(nn.Module):
    """GPT-2's topology (12 pre-LN blocks, tied embeddings) at width ``d``."""

    def __init__(self, vocab=64, d=32, heads=2, layers=12, seq=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


MODELS = {
    "resnet50-narrow": (
        lambda: NarrowResNet50(),
        lambda g: (torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)),
    ),
    "gpt2-narrow": (
        lambda: NarrowGPT2(),
        lambda g: (
            torch.randint(0, 64, (2, 16), generator=g),
            torch.randint(0, 64, (2, 16), generator=g),
        ),
    ),
}


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


def make_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _time(fn, batches):
    t0 = time.perf_counter()
    for x, y in batches:
        fn(x, y)
    return (time.perf_counter() - t0) / len(batches)


def _launches(step, x, y):
    """The (executable, key, arrays) of every program one steady call of ``step`` launches."""
    seen = []
    lower.launch_hook = lambda exe, key, arrays: seen.append((exe, key, list(arrays)))
    try:
        step(x, y)
    finally:
        lower.launch_hook = None
    return seen


def _program_time(launches, n):
    """Seconds per step of the programs alone (launch + execution), replayed on the same inputs."""
    t0 = time.perf_counter()
    for _ in range(n):
        for exe, key, arrays in launches:
            jax.block_until_ready(exe(key, *arrays))
    return (time.perf_counter() - t0) / n


class _ProgramTimer:
    """Wraps a compiled step's executable: accumulates the time of each launch + execution."""

    def __init__(self, exe):
        self.exe, self.seconds = exe, 0.0

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.exe(*args))
        self.seconds += time.perf_counter() - t0
        return out


def _timer_of(step):
    """Install a _ProgramTimer on compile_step's flat-buffer program (None for other modes)."""
    progs = list(getattr(step, "_programs", {}).values())
    if len(progs) != 1 or getattr(progs[0], "flat", None) is None or progs[0].flat.exe is None:
        return None
    flat = progs[0].flat
    timer = flat.exe = _ProgramTimer(flat.exe)
    return timer


def measure(name, mode, steps, repeats):
    build, batch = MODELS[name]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    eager_model = build()
    model = copy.deepcopy(eager_model)
    eager_step = make_step(eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-3))
    if mode == "compile_step":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = torchacc.dynamo.compile_step(make_step(model, opt))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        step = make_step(torch.compile(model, backend="torchacc"), opt)
    batches = [batch(g) for _ in range(steps)]
    for x, y in batches[:3]:  # eager warm-up, trace + compile, first steady call
        step(x, y)
        eager_step(x, y)
    timer = _timer_of(step)
    rows = []
    for _ in range(repeats):
        e = _time(eager_step, batches)
        if timer is not None:
            timer.seconds = 0.0
        s = _time(step, batches)
        inline = s - timer.seconds / len(batches) if timer is not None else None
        p = _program_time(_launches(step, *batches[0]), len(batches))
        rows.append((e, s, p, inline, None if inline is None else inline / e))
    e = statistics.median(r[0] for r in rows)
    s = statistics.median(r[1] for r in rows)
    p = statistics.median(r[2] for r in rows)
    inline = statistics.median(r[3] for r in rows) if timer is not None else None
    inline_ratio = statistics.median(r[4] for r in rows) if timer is not None else None
    return {
        "model": name,
        "mode": mode,
        "params": sum(t.numel() for t in model.parameters()),
        "param_tensors": len(list(model.parameters())),
        "eager_ms": e * 1e3,
        "step_ms": s * 1e3,
        "program_ms": p * 1e3,
        "host_ms": (s - p) * 1e3,
        "host_over_eager": (s - p) / e,
        "host_inline_ms": None if inline is None else inline * 1e3,
        "host_inline_over_eager": inline_ratio,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="compile_step,torch.compile")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            r = measure(name, mode, args.steps, args.repeats)
            results.append(r)
            print(
                f"{r['model']:16s} {r['mode']:13s} eager {r['eager_ms']:7.2f} ms  step "
                f"{r['step_ms']:7.2f} ms  program {r['program_ms']:7.2f} ms  host "
                f"{r['host_ms']:6.2f} ms = {r['host_over_eager']:.3f}x eager"
                + (
                    f"  host in-step {r['host_inline_ms']:6.2f} ms = "
                    f"{r['host_inline_over_eager']:.3f}x eager"
                    if r["host_inline_ms"] is not None
                    else ""
                ),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
