"""The same GPT trained under torchacc.parallel's four modes on one machine's devices: per-device
memory of the weights and optimizer state, step time and losses side by side.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python -m gallery.parallel.modes [--model gpt-tiny]

Every mode starts from the same weights and batches; the table is Markdown (gallery/parallel/
README.md shows one). STAND_ALONE runs the whole step on every device (nothing is split).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402

import torchacc  # noqa: E402
import torchacc.parallel as par  # noqa: E402
from gallery.gpt.model import build_gpt  # noqa: E402
from torchacc.distributed import sharding  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGY = os.path.join(HERE, "..", "gpt", "strategy_semi_auto.yaml")


def run(mode, args, budget=None):
    par.reset_auto_parallel_context()
    par.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True)
    if budget is not None:
        par.set_auto_parallel_context(device_memory_budget=budget)
    torch.manual_seed(0)
    model = build_gpt(args.model)
    vocab = model.config.vocab_size
    if mode == "semi_auto_parallel":
        par.apply_strategies(model, par.load_strategy_file(STRATEGY), STRATEGY)
    model = par.parallelize(model.to(torchacc.device()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(args.steps):
        x = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        y = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        t0 = time.perf_counter()
        logits = model(x.to(torchacc.device()))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), y.to(torchacc.device()).reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        losses.append(loss.item())  # waits for the step
        times.append(time.perf_counter() - t0)
    state = [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    per_device = sharding.per_device_bytes(list(model.parameters()) + state)
    return {
        "mode": mode,
        "bytes": max(per_device.values()),
        "step_ms": 1000 * statistics.median(times[2:]),
        "losses": losses,
        "table": par.strategy_table(model) if mode == "auto_parallel" else None,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    par.init()
    rows = [run(m, args) for m in ("stand_alone", "data_parallel", "semi_auto_parallel")]
    budget = int(rows[0]["bytes"] * 0.7)  # below the replicated footprint: AUTO must split
    rows.append(run("auto_parallel", args, budget))
    n = par.get_group_size()
    print(f"{args.model}, batch {args.batch} x {args.seq} tokens, AdamW, {n} devices")
    print("| mode | weights + AdamW state per device | step time (median) | loss after |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['bytes'] / 2**20:.2f} MiB | {r['step_ms']:.1f} ms | "
            f"{r['losses'][-1]:.5f} |"
        )
    print(f"\nAUTO_PARALLEL budget {budget} B:\n{rows[-1]['table']}")


if __name__ == "__main__":
    main()
