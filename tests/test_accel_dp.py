"""``accelerate()`` with ``dist.dp`` over 2 processes (torchrun): on the lazy backend the gradients
are averaged by an all-reduce recorded into the step, on the eager backend by torch DDP (and with
``dist.fsdp`` sharded by FSDP2). Either way the ranks' mean loss equals one process training on
the full batch, and the replicas end identical to it (rank 0's initial weights everywhere)."""

import json
import os
import subprocess
import sys

import accel_dp_worker as worker
import pytest
import torch
from distributed_launch import env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_two_process_data_parallel_equals_the_full_batch(tmp_path):
    out = tmp_path / "result"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        os.path.join(HERE, "accel_dp_worker.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.load(open(f"{out}.{r}.json")) for r in range(2)]
    torch.manual_seed(0)
    model = worker.Net()  # rank 0's initial weights
    expected = worker.train(model, worker.batches())
    want_params = [p.detach().flatten().tolist() for p in model.parameters()]
    for backend in ("lazy", "eager", "eager-fsdp"):
        mean = [(a + b) / 2 for a, b in zip(*(r[backend]["losses"] for r in ranks), strict=True)]
        torch.testing.assert_close(mean, expected, rtol=1e-4, atol=1e-5, msg=backend)
        assert ranks[0][backend]["params"] == ranks[1][backend]["params"], f"{backend} replicas"
        for got, want in zip(ranks[0][backend]["params"], want_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=backend)
