"""What mapping ``device="xla"`` with a ``TorchFunctionMode`` would cost, next to the wrappers.

Note [The xla device string] maps ``xla`` at the dispatcher (factories) and wraps five Python entry
points. The alternative the issue names (torchax's way for ``device="jax"``) is a global
``TorchFunctionMode`` that looks at every torch call's ``device`` argument. This runs
benchmarks/host_cost.py's compiler step (same narrow gallery models, same step) with such a mode
active and without it, alternating, and prints the host time per step of each (record +
mark_step, milliseconds; medians over the repeats).

Usage: python benchmarks/xla_device_cost.py [--steps 10] [--repeats 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import host_cost  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from torchacc.torch_xla import _xla_device  # noqa: E402


class XlaDeviceMode(TorchFunctionMode):
    """Rewrites an ``xla`` ``device=`` keyword of any torch call (the per-call check is the
    cost: one Python frame and a dict lookup per torch function call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _xla_device._is_xla(device):
                kwargs = dict(kwargs, device=_xla_device.resolve(device))
        return func(*args, **(kwargs or {}))


def host_ms(model, steps, repeats, mode):
    if mode:
        with XlaDeviceMode():
            row = host_cost.measure(model, "syncfree-adamw", steps, repeats)
    else:
        row = host_cost.measure(model, "syncfree-adamw", steps, repeats)
    return row["record_ms"] + row["mark_step_ms"], row["eager_step_ms"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default=",".join(host_cost.MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | host ms/step, no mode | with TorchFunctionMode | change |")
    print("|---|---|---|---|")
    for model in args.models.split(","):
        plain, moded = [], []
        for _ in range(args.rounds):
            plain.append(host_ms(model, args.steps, args.repeats, False)[0])
            moded.append(host_ms(model, args.steps, args.repeats, True)[0])
        a, b = statistics.median(plain), statistics.median(moded)
        print(f"| {model} | {a:.1f} | {b:.1f} | {100 * (b - a) / a:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
