"""``torchacc.compile_step`` in a 2-process job: the gradient all-reduce (``xm.optimizer_step``,
``xm.reduce_gradients``, ``xm.all_reduce``) compiles into the step's one program (an SPMD program
over the process mesh, psum over gloo on the CPU) and trains like eager PyTorch DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from distributed_launch import REPO, env, free_port, report

# the three tests read one 2-process job (module fixture): one xdist worker runs it once
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.xdist_group("dynstep_ddp")]

WORKER = os.path.join(REPO, "tests", "dynamo_step_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynstep")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        WORKER,
        str(out),
    ]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=360, cwd=REPO)
    assert p.returncode == 0, report(p)
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


@pytest.mark.parametrize("api", ["optimizer_step", "reduce_gradients", "all_reduce"])
def test_compiled_step_matches_eager_ddp(ranks, api):
    runs = [r[api] for r in ranks]
    for rank, run in enumerate(runs):
        got, want = run["losses"]["compiled"], run["losses"]["eager"]
        for i, (c, e) in enumerate(zip(got, want, strict=True)):
            assert abs(c - e) <= 1e-5 * max(1.0, abs(e)), (rank, i, got, want)
        assert run["max_param_diff"] <= 1e-5, (rank, run["max_param_diff"])
        # one program holding forward, backward, the all-reduce and AdamW; traced once
        assert run["counters"] == {
            "StepTrace": 1,
            "StepRecompile": 0,
            "StepExecute": 4,
            "DynamoCompile": 1,
        }, run["counters"]
        assert run["flat"] and run["collective"]
    # each rank saw different data, yet the replicas stayed identical: gradients were averaged
    assert runs[0]["losses"]["compiled"] != runs[1]["losses"]["compiled"]
    assert runs[0]["params"] == runs[1]["params"]
