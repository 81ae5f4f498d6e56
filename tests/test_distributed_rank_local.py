"""Rank-local reads never hang; a collective some ranks skip is an error, not a hang.

Programs without a cross-process collective are each process's own business (Note [Aligning
collective programs] in torchacc/sharding/manual.py).
"""

import os
import subprocess
import sys
import time

import pytest
from distributed_launch import REPO, env, free_port

WORKER = os.path.join(REPO, "tests", "rank_local_worker.py")


def _torchrun(mode, timeout, **extra):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        WORKER,
        mode,
    ]
    return subprocess.run(
        cmd, env=env(**extra), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.mark.slow
def test_rank_zero_logging_does_not_hang():
    proc = _torchrun("log", 240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "done 0 same=True" in out and "done 1 same=True" in out, out[-4000:]
    assert out.count("rank-0 only value") == 4


@pytest.mark.slow
def test_a_collective_one_rank_skips_is_an_error_naming_the_rank():
    start = time.time()
    proc = _torchrun("skip", 240, TORCHACC_COLLECTIVE_TIMEOUT=10)
    took = time.time() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "rank 1 has not reached it in 10 s" in out, out[-4000:]
    assert "collective program #" in out and "step" in out
    assert "SKIP-NOT-DETECTED" not in out
    assert took < 120, took
