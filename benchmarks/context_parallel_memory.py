"""Per-device attention memory of context parallel, from XLA's memory analysis of the compiled
regions (CPU platform, 4 virtual devices; memory sizes do not depend on the platform's speed).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python benchmarks/context_parallel_memory.py --seq 2048 --heads 8 --head-dim 64

For Ulysses, the causal zig-zag ring and 2-D (cp = 4 as 2 x 2), at cp = 1, 2, 4: the temporary
bytes per device of the forward and of forward + backward (q, k, v split on the sequence), and
their ratio to cp = 1. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from torchacc.ops import context_parallel as cp  # noqa: E402


def temp_bytes(fn, mesh, seq, shape):
    arg = jax.ShapeDtypeStruct(
        shape, jax.numpy.float32, sharding=NamedSharding(mesh, PartitionSpec(None, seq))
    )
    return jax.jit(fn).lower(arg, arg, arg).compile().memory_analysis().temp_size_in_bytes


def fwd_bwd(f):
    return lambda q, k, v: jax.vjp(f, q, k, v)[1](q)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    scale = a.head_dim**-0.5
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "inter", "intra"))
    plain = cp._make_attention(one, None, (), (), scale, True, False)
    base = [temp_bytes(g, one, None, shape) for g in (plain, fwd_bwd(plain))]
    print(f"shape {shape} fp32, causal; MiB per device (ratio to cp = 1)\n")
    print("| op | cp | forward | forward + backward |")
    print("|---|---|---|---|")
    print(f"| unsharded | 1 | {base[0] / 2**20:.1f} | {base[1] / 2**20:.1f} |")
    for n, intra in ((2, None), (4, None), (4, 2)):
        group = cp.initialize_context_parallel(n, intra)
        if intra:
            cases = [("2-D (2 x 2)", ("intra",), ("inter",))]
        else:
            cases = [("ulysses", group.axes, ()), ("ring (zig-zag)", (), group.axes)]
        for name, a2a, ring in cases:
            f = cp._make_attention(group.mesh, None, a2a, ring, scale, True, False)
            got = [temp_bytes(g, group.mesh, group.spec, shape) for g in (f, fwd_bwd(f))]
            cells = [f"{x / 2**20:.1f} ({x / b:.3f})" for x, b in zip(got, base)]
            print(f"| {name} | {n} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
