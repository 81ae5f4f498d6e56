"""Sharded training on 1, 2 and 4 devices: step time, host cost and bytes per device (FSDPv2).

A GPT-2-small-shaped model (12 blocks, d=768, 12 heads, vocab 50,257: its embedding's 50,257
rows are padded over 2 and 4 devices, Note [Padded shards]) trains with AdamW (fp32) under
``SpmdFullyShardedDataParallel`` over an ``fsdp`` mesh of N devices, one process; N=1 is the
same model on the same path (a mesh of one device). Each device count runs in its own process
(``CPU_NUM_DEVICES=N`` must be set before JAX starts). Per device count it reports:

- step ms: median wall time of a synced step (record + mark_step + wait) after warm-up;
- host ms: median host time of record + mark_step without the executable call (XLA:CPU runs
  the program inside it), the part the sharding engine adds to; record ms: the recording alone;
  ``--baseline`` also runs the unsharded one-device-per-process path (no use_spmd) for it;
- parameter / gradient / optimizer-state bytes on the fullest device after a step.

On a CPU the "devices" share the same cores, so step time does not fall with N; the bytes do.

Usage: python benchmarks/spmd.py [--devices 1 2 4] [--steps 6] [--layers 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


NARROW = {"n_embd": 64, "n_head": 4, "vocab_size": 512}  # benchmarks/host_cost.py's gpt2-narrow


def _measure(devices, steps, layers, batch, seq, spmd, narrow=False):
    import numpy as np
    import torch

    if spmd:
        import torchacc.torch_xla.runtime as xr

        xr.use_spmd()
    import torchacc
    import torchacc.torch_xla.distributed.spmd as xs
    from gallery.gpt.model import build_gpt
    from torchacc.distributed import sharding
    from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel,
    )

    torch.manual_seed(0)
    overrides = dict(NARROW) if narrow else {}
    model = build_gpt("gpt2", n_layer=layers, **overrides).to(torchacc.device())
    mesh = None
    if spmd:
        mesh = xs.Mesh(np.arange(devices), (devices,), ("fsdp",))
        model = SpmdFullyShardedDataParallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    from torchacc import metrics

    def executed():
        data = metrics.metric_data("ExecuteTime")
        return data[1] if data else 0.0

    walls, hosts, records = [], [], []
    report = None
    for i in range(steps + 2):
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        y = torch.randint(0, vocab, (batch, seq), generator=gen)
        t0 = time.perf_counter()
        xd, yd = x.to(torchacc.device()), y.to(torchacc.device())
        if spmd:
            xs.mark_sharding(xd, mesh, ("fsdp", None))
        loss = torch.nn.functional.cross_entropy(model(xd).view(-1, vocab), yd.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        tr = time.perf_counter()
        ran = executed()
        torchacc.sync()
        t1 = time.perf_counter() - (executed() - ran)  # XLA:CPU runs the program in this call
        torchacc.wait_device_ops()
        t2 = time.perf_counter()
        if i >= 2:
            records.append(tr - t0)
            hosts.append(t1 - t0)
            walls.append(t2 - t0)
        if i == 1 and spmd:
            report = sharding.memory_report(model, opt)
    row = {
        "devices": devices,
        "spmd": spmd,
        "step_ms": 1e3 * statistics.median(walls),
        "host_ms": 1e3 * statistics.median(hosts),
        "record_ms": 1e3 * statistics.median(records),
        "loss": float(loss.item()),
    }
    if report:
        row.update({k: max(v.values()) if v else 0 for k, v in report.items()})
    else:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa
        params = list(model.parameters())
        row["parameters"] = nbytes(params)
        row["gradients"] = nbytes([p.grad for p in params])
        row["optimizer_state"] = nbytes(
            [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
        )
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--baseline", action="store_true", help="also run without use_spmd")
    p.add_argument(
        "--narrow",
        action="store_true",
        help="d=64, vocab 512 (host cost: on XLA:CPU a program runs in the calling thread, so "
        "only tiny tensors show the host's share)",
    )
    p.add_argument("--repeats", type=int, default=1, help="run the configurations this often")
    p.add_argument("--json")
    p.add_argument("--_child", nargs=2, metavar=("DEVICES", "SPMD"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        n, spmd = int(args._child[0]), args._child[1] == "1"
        row = _measure(n, args.steps, args.layers, args.batch, args.seq, spmd, args.narrow)
        print("ROW " + json.dumps(row), flush=True)
        return
    runs = [(n, True) for n in args.devices] + ([(1, False)] if args.baseline else [])
    runs = runs * args.repeats  # alternating: machine drift hits every configuration alike
    rows = []
    for n, spmd in runs:
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n), TORCHACC_CACHE_DIR="off")
        env.setdefault("JAX_PLATFORMS", "cpu")
        cmd = [
            sys.executable,
            __file__,
            "--_child",
            str(n),
            "1" if spmd else "0",
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
        ] + (["--narrow"] if args.narrow else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        line = [x for x in out.stdout.splitlines() if x.startswith("ROW ")]
        if not line:
            sys.exit(f"devices={n}: {out.stderr[-3000:]}")
        rows.append(json.loads(line[0][4:]))
        r = rows[-1]
        print(
            f"{'fsdp' if r['spmd'] else 'plain'} x{r['devices']}: step {r['step_ms']:.0f} ms, "
            f"host {r['host_ms']:.1f} ms (record {r['record_ms']:.1f}), "
            f"per device: params {r['parameters']:,} B, "
            f"grads {r['gradients']:,} B, optimizer state {r['optimizer_state']:,} B, "
            f"loss {r['loss']:.4f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
