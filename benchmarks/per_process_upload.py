"""Bytes and time each process spends uploading a GPT-2 batch in a multi-process SPMD job: every
process uploading the global batch (replicated, then split by ``mark_sharding``: the only way
before per-process batches) vs each process uploading its own share through ``MpDeviceLoader``
(Note [Per-process batches] in torchacc/sharding/data.py).

    python benchmarks/per_process_upload.py [--nproc 2] [--devices 2] [--batch 8] [--seq 1024]

starts ``--nproc`` processes of ``--devices`` CPU devices each (torchrun) and prints, per way,
the bytes that reached each process's devices per batch (``TransferToDeviceBytes``) and the
median upload seconds over ``--batches`` batches. GPU: run the worker under torchrun yourself
(``python -m torch.distributed.run --nproc_per_node N benchmarks/per_process_upload.py
--worker``), on a machine whose GPUs split evenly over the N processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args):
    sys.path.insert(0, ROOT)
    import torchacc.torch_xla.runtime as xr

    xr.use_spmd()
    import numpy as np
    import torch

    import torchacc as ta
    import torchacc.torch_xla.distributed.parallel_loader as pl
    import torchacc.torch_xla.distributed.spmd as xs
    from torchacc import metrics

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    vocab, local = 50257, args.batch // world
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, vocab, (args.batch, args.seq), generator=gen),) * 2
        for _ in range(args.batches)
    ]
    out = {}

    def measure(name, feed):
        metrics.clear_all()
        times = []
        for item in feed():
            start = time.perf_counter()
            tensors = item()
            for t in tensors:
                t._st.value.buf.block_until_ready()
            times.append(time.perf_counter() - start)
        sent = metrics.counter_value("TransferToDeviceBytes") or 0
        out[name] = {"bytes_per_batch": sent // args.batches, "median_s": statistics.median(times)}

    def global_way():  # every process: the global batch, replicated, then split
        for x, y in batches:

            def item(x=x, y=y):
                xd, yd = x.to(ta.device()), y.to(ta.device())
                for t in (xd, yd):
                    xs.mark_sharding(t, mesh, ("fsdp", None))
                return xd, yd

            yield item

    def local_way():  # every process: its share, through the loader
        shares = [
            (x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local])
            for x, y in batches
        ]
        loader = iter(
            pl.MpDeviceLoader(
                shares, ta.device(), input_sharding=xs.ShardingSpec(mesh, ("fsdp", None))
            )
        )
        for _ in shares:
            yield lambda: next(loader)

    measure("global batch on every process", global_way)
    measure("each process its share (loader)", local_way)
    global_bytes = 2 * args.batch * args.seq * 8
    if rank == 0:
        print(json.dumps({"global_batch_bytes": global_bytes, **out}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(args.devices),
        PYTHONPATH=ROOT,
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        os.path.abspath(__file__),
        "--worker",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--batches={args.batches}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    print([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


if __name__ == "__main__":
    main()
