"""Per-device temporary memory of the pipelined step, GPipe against 1F1B, from XLA's memory
analysis of the compiled step (CPU platform, 4 virtual devices; memory sizes do not depend on
the platform's speed).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python benchmarks/pipeline_memory.py --width 512 --micro-batch 64 --micro 4 8 16

pp = 4 stages of two tanh(x W + b) layers each (torchacc/pipeline/schedules.py on a plain JAX
stage function), for each number of micro-batches M: the temporary bytes per device of the
forward + backward step under GPipe (the backward is JAX's VJP of the scan: every tick's
residuals are kept) and 1F1B (at most min(M, 2 pp - 1) stage inputs stashed). Prints a markdown
table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from torchacc.pipeline.schedules import Plan, make_step  # noqa: E402

S = 4


def stage(k, width):
    def f(params, shared, consts, bnd, data, key):
        x = data[0] if k == 0 else bnd[0]
        for i in range(2):
            x = jnp.tanh(x @ params[2 * i] + params[2 * i + 1])
        if k == S - 1:
            return [((x - data[1]) ** 2).mean()]
        return [x]

    return f


def temp_bytes(schedule, width, mb, micro):
    mesh = jax.make_mesh((S,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,))
    w = width * width
    layout = (
        (0, 0, (width, width)),
        (0, w, (width,)),
        (0, w + width, (width, width)),
        (0, 2 * w + width, (width,)),
    )
    plan = Plan(
        mesh,
        "pp",
        S,
        micro,
        tuple(stage(k, width) for k in range(S)),
        (layout,) * S,
        ((jnp.float32, 2 * (w + width)),),
        tuple((((mb, width), jnp.float32),) for _ in range(S - 1)),  # one (mb, width) boundary
        schedule,
    )
    step = make_step(plan)
    packed = jax.ShapeDtypeStruct((S, 2 * (w + width)), jnp.float32)
    x = jax.ShapeDtypeStruct((micro * mb, width), jnp.float32)
    lowered = jax.jit(step).lower([packed], [], [], [x, x], None)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    a = p.parse_args()
    act = a.micro_batch * a.width * 4
    print(
        f"pp = {S}, width {a.width}, micro-batch {a.micro_batch} rows "
        f"(one stage input: {act / 2**10:.0f} KiB)\n"
    )
    print("| micro-batches M | GPipe temp / device | 1F1B temp / device | 1F1B / GPipe |")
    print("|---:|---:|---:|---:|")
    for m in a.micro:
        g = temp_bytes("gpipe", a.width, a.micro_batch, m)
        f = temp_bytes("1f1b", a.width, a.micro_batch, m)
        print(f"| {m} | {g / 2**20:.2f} MiB | {f / 2**20:.2f} MiB | {f / g:.2f} |")


if __name__ == "__main__":
    main()
