"""GPT-2's cold first steps, with or without an optimizer, and where their time goes.

Builds the gallery's GPT-2 (124M, ``build_gpt("gpt2")``) on the torchacc device and runs
``steps`` training steps of seq 64, batch 1; per step it prints the process CPU seconds (all
threads) and wall seconds, the recording time, and for each program compiled in the step JAX's
trace + lowering CPU seconds, XLA's compile (CPU s, wall s) and the lowered module's size in
characters. ``what``: ``fwdbwd`` (no optimizer: forward and backward, the gradients kept),
``foreach`` (``torch.optim.AdamW``), ``fused`` (``fused=True``) or ``syncfree``
(``torchacc.amp.syncfree.AdamW``); ``fwdbwd-dropped`` is what ``fwdbwd`` measured before
2026-11-25 16:00 UTC: ``zero_grad()`` right after ``backward()`` drops the gradients unread, so
XLA removes the whole backward and only the forward is compiled and run. Run it in a fresh
process with an empty persistent cache for a cold step.

``torch._dynamo`` (~0.5 CPU s of imports) is imported before any step: the first forward on the
device imports it, and so does ``torch.optim``'s constructor, which ran outside the timed step,
so the optimizer modes' first step did not pay it and ``fwdbwd``'s did.

Usage: TORCHACC_CACHE_DIR=off python benchmarks/cold_step.py foreach [steps]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCHACC_CACHE_DIR", "off")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax._src.stages as stages  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (imported here, not inside the first timed step; see below)

import torchacc  # noqa: E402
import torchacc.amp.syncfree  # noqa: E402
from gallery.gpt.model import build_gpt  # noqa: E402
from torchacc.program import cache  # noqa: E402

info = {"lower": [], "compile": [], "hlo": []}
_compile = stages.Lowered.compile


def _timed_compile(self, *args, **kwargs):
    info["hlo"].append(len(self.as_text()))
    cpu, wall = time.process_time(), time.perf_counter()
    result = _compile(self, *args, **kwargs)
    spent = (time.process_time() - cpu, time.perf_counter() - wall)
    info["compile"].append(tuple(round(t, 2) for t in spent))
    return result


class _TimedJit:
    def __init__(self, fn):
        self.fn = fn

    def lower(self, *args):
        cpu = time.process_time()
        lowered = self.fn.lower(*args)
        info["lower"].append(round(time.process_time() - cpu, 2))
        return lowered


class _Jax:  # the jax module as program/cache.py sees it, with jit's lowering timed
    jit = staticmethod(lambda *a, **k: _TimedJit(jax.jit(*a, **k)))

    def __getattr__(self, name):
        return getattr(jax, name)


def main():
    what = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    stages.Lowered.compile = _timed_compile
    cache.jax = _Jax()
    torch.manual_seed(0)
    dev = torch.device("torchacc")
    model = build_gpt("gpt2").to(dev)
    params = model.parameters()
    opt = {
        "fwdbwd": lambda: None,
        "fwdbwd-dropped": lambda: None,
        "foreach": lambda: torch.optim.AdamW(params, lr=1e-4),
        "fused": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True),
        "syncfree": lambda: torchacc.amp.syncfree.AdamW(params, lr=1e-4),
    }[what]()
    torchacc.sync()
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, 50257, (1, 64), generator=g).to(dev)
        cpu, wall = time.process_time(), time.perf_counter()
        if what == "fwdbwd":
            model.zero_grad()  # before the step: its gradients are results, so computed
        loss = model(idx).float().square().mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        elif what == "fwdbwd-dropped":
            model.zero_grad()  # drops the gradients unread: XLA removes the backward
        recorded = time.process_time()
        n = len(info["compile"])
        torchacc.sync()
        float(loss.item())
        out.append(
            {
                "cpu": round(time.process_time() - cpu, 2),
                "wall": round(time.perf_counter() - wall, 2),
                "record": round(recorded - cpu, 2),
                "lower": info["lower"][n:],
                "compile": info["compile"][n:],
                "hlo": info["hlo"][n:],
            }
        )
    print(json.dumps({"what": what, "steps": out, "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
