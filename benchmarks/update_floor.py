"""Floors for GPT-2 124M's AdamW update on this machine, outside torchacc.

``python benchmarks/update_floor.py jax|foreach|fused``: one AdamW step over arrays of the
gallery GPT-2's 148 parameter shapes (124.4M floats), median process CPU and wall seconds of 5
steps. ``jax``: one jitted JAX AdamW (parameters and moments donated; prints XLA's bytes
accessed); ``foreach`` / ``fused``: eager ``torch.optim.AdamW`` on CPU tensors.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from gallery.gpt.model import build_gpt  # noqa: E402


def _timed(fn, n=5):
    runs = []
    for _ in range(n):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        runs.append((time.process_time() - cpu, time.perf_counter() - wall))
    return [round(statistics.median(x), 3) for x in zip(*runs)]


def _adamw(ps, gs, ms, vs, lr, b1, b2, eps, wd, bc1, bc2):
    out = ([], [], [])
    for p, g, m, v in zip(ps, gs, ms, vs):
        p = p * (1 - lr * wd)
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        p = p - (lr / bc1) * m / (jnp.sqrt(v) / bc2 + eps)
        out[0].append(p)
        out[1].append(m)
        out[2].append(v)
    return out


def main():
    what = sys.argv[1]
    shapes = [tuple(p.shape) for p in build_gpt("gpt2").parameters()]
    if what in ("foreach", "fused"):
        ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4, **{what: True})
        opt.step()
        print(what, "eager torch AdamW step (CPU s, wall s):", _timed(opt.step))
        return
    ps = [jnp.full(s, 0.02) for s in shapes]
    gs = [jnp.full(s, 0.01) for s in shapes]
    ms = [jnp.zeros(s) for s in shapes]
    vs = [jnp.zeros(s) for s in shapes]
    scalars = [jnp.float32(x) for x in (1e-4, 0.9, 0.999, 1e-8, 0.01, 0.1, 0.03)]
    exe = jax.jit(_adamw, donate_argnums=(0, 2, 3)).lower(ps, gs, ms, vs, *scalars).compile()
    analysis = exe.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    print("bytes accessed: %.3f GB" % (analysis["bytes accessed"] / 1e9))
    state = [ps, ms, vs]

    def step():
        state[0], state[1], state[2] = exe(state[0], gs, state[1], state[2], *scalars)
        jax.block_until_ready(state)

    step()
    print("jitted JAX AdamW step (CPU s, wall s):", _timed(step))


if __name__ == "__main__":
    main()
