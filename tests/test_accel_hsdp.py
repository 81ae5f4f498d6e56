"""``accelerate(backend='eager')`` with ``dist.dp`` x ``dist.fsdp`` (2 x 2, 4 processes under
torchrun on CPU gloo) is torch's HSDP: FSDP2 over a 2-D device mesh, parameters replicated over
dp and sharded over fsdp. The ranks' mean loss and the final parameters equal one process
training on the global batch."""

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
def test_eager_dp_x_fsdp_is_hsdp_and_equals_the_global_batch(tmp_path):
    out = tmp_path / "result"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        os.path.join(HERE, "accel_hsdp_worker.py"),
        str(out),
    ]
    proc = subprocess.run(
        cmd, env=env(TORCHACC_DISTRIBUTED="0"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.load(open(f"{out}.{r}.json")) for r in range(4)]
    torch.manual_seed(0)
    model = worker.Net()  # rank 0's initial weights
    expected = worker.train(model, worker.batches())
    want = [p.detach().flatten().tolist() for p in model.parameters()]
    for r in ranks:
        # replicated over dp (the mesh's rows: ranks {0, 2} and {1, 3}), fc1's 16 rows split
        # over fsdp (consecutive ranks, one node)
        assert r["layout"] == {
            "placements": ["Replicate", "Shard"],
            "mesh": [[0, 1], [2, 3]],
            "local_rows": 8,
        }, r["layout"]
        for got, w in zip(r["params"], want, strict=True):
            torch.testing.assert_close(got, w, rtol=0, atol=1e-5)
    mean = [sum(losses) / 4 for losses in zip(*(r["losses"] for r in ranks), strict=True)]
    torch.testing.assert_close(mean, expected, rtol=0, atol=1e-5)
