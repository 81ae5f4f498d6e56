"""Where a training step's host memory goes, eager vs the lazy device (CPU platform), by category.

    python benchmarks/accel_memory.py --mode eager --model gpt2 --batch 4 --seq 256 --steps 4
    python benchmarks/accel_memory.py --mode lazy  --model gpt2 --batch 4 --seq 256 --steps 4 [--gc]

One process per mode (peak RSS is per process). GPT-2 from the gallery, bf16 autocast, AdamW,
trained through ``torchacc.accelerate`` (``backend='eager'`` or ``'lazy'``). Prints one JSON line:
RSS (current and peak, GiB) after import, after building the model, after ``accelerate()`` and
after each step; the last step's own peak (VmHWM reset before it, so no compile is in it); for
the lazy mode the last step program's ``memory_analysis()`` (argument, output, aliased = donated,
temp bytes) and the optimizer state's bytes. Together they attribute the difference to eager:
executable temp buffers, outputs not donated, compile-time memory, host copies kept after
``.to(device)``."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30


def rss():
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / GIB, 3)


def peak():
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3)


def reset_peak():
    """Linux: restart the peak RSS (VmHWM) count from now (so a later step's peak excludes the
    compiles of the first steps); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / GIB, 3)
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("eager", "lazy"), required=True)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gc", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(2)
    import torchacc as ta
    from gallery.gpt.model import build_gpt

    out = {"mode": args.mode, "gc": args.gc, "stages": [("import", rss(), peak())]}
    torch.manual_seed(0)
    model = build_gpt(args.model)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["param_GiB"] = round(nbytes / GIB, 3)
    out["stages"].append(("model built", rss(), peak()))
    config = ta.Config(backend=args.mode)
    config.compute.bf16 = True
    if args.gc:
        config.memory.gc, config.memory.gc_cls = True, {"Block"}
    model = ta.accelerate(model, config=config)
    out["stages"].append(("accelerate", rss(), peak()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        if step == args.steps - 1:
            out["peak_reset"] = reset_peak()  # the last step's own peak, no compile in it
        ids = torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g)
        x, y = ids[:, :-1].to(model.device), ids[:, 1:].to(model.device)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.mode == "lazy":
            ta.sync(wait=True)
        out["stages"].append((f"step {step + 1}", rss(), peak()))
    out["last_step_peak_GiB"] = hwm() if out.get("peak_reset") else None
    out["loss"] = loss.item()
    if args.mode == "lazy":
        from torchacc.program import cache

        stats = list(cache._cache.values())[-1].memory_analysis()
        out["program"] = {
            k: round(getattr(stats, f"{k}_size_in_bytes") / GIB, 3)
            for k in ("argument", "output", "alias", "temp")
        }
        state = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        out["optimizer_state_GiB"] = round(state / GIB, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
