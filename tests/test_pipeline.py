"""Pipeline parallel (``ta.dist.PipelineParallel``, torchacc/pipeline/) against the eager model.

The SPMD cases live in tests/spmd_cases/case_pipeline.py and run in one fresh process with 4 CPU
devices (the device count must be set before JAX starts, and SPMD mode is for the whole
process).
"""

import os

import pytest
from spmd_launch import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_pipeline")
def test_pipeline_cases_on_4_devices():
    out = run_cases("case_pipeline.py")
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.devices(4)
@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    os.environ.get("TORCHACC_TEST_TORCHACC_SCRIPTS") != "1"
    or not os.environ.get("TORCHACC_CHECKOUT"),
    reason="needs an AlibabaPAI/torchacc checkout (TORCHACC_CHECKOUT) and "
    "TORCHACC_TEST_TORCHACC_SCRIPTS=1: 4 processes x (torch + JAX) take minutes on a 2-core box",
)
def test_torchacc_pipeline_script_gc_bf16_under_torchrun():
    """AlibabaPAI/torchacc's tests/standalone/pipeline.py from a checkout, unchanged,
    as its run_tests.sh starts it (``--pp_num 4 --gc --bf16``) on 4 processes x 1 CPU device:
    the stages live on the job-wide mesh's process axis; MNIST is an offline stand-in. Two
    steps, each printing a finite loss."""
    import math
    import re
    import sys

    from distributed_launch import env, free_port
    from spmd_launch import REPO, _run

    here = os.path.join(REPO, "tests", "torchacc_scripts")  # the offline torchvision stand-in
    checkout = os.environ["TORCHACC_CHECKOUT"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        os.path.join(checkout, "tests", "standalone", "pipeline.py"),
        *"--pp_num 4 --gc --bf16 --train_steps 2".split(),
    ]
    utils = os.path.join(checkout, "tests", "utils")  # its EchoDataset and set_seed
    path = os.pathsep.join([REPO, utils, os.path.join(here, "offline")])
    proc = _run(cmd, env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=1, PYTHONPATH=path), 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [float(v) for v in re.findall(r"step: \d+, loss: (\S+)", proc.stdout)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), proc.stdout[-3000:]
