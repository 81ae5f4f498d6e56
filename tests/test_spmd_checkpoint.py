"""Distributed checkpoints (torch.distributed.checkpoint with torch_xla's SPMD planners and
CheckpointManager) of sharded training state, saved on 4 CPU devices and loaded into other
layouts.

The cases live in tests/spmd_cases/ and run in fresh processes (the device count must be set
before JAX starts): case_checkpoint.py saves on a 2x2 data x model mesh and checks the
checkpoint, same-mesh restores, bad shapes, crashes mid-save, async saves and weights_only
reads; case_checkpoint_reshard.py loads that checkpoint on 2 devices (another mesh, replicated,
CPU tensors) and on 1 device without SPMD.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_case(name, devices, ckpt_dir, extra_env=None, timeout=600):
    env = dict(
        os.environ,
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(devices),
        TORCHACC_CKPT_DIR=str(ckpt_dir),
        **(extra_env or {}),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            os.path.join(HERE, "spmd_cases", name),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_checkpoint")
def test_checkpoint_saved_on_4_devices_restores_on_4_2_and_1(tmp_path):
    _run_case("case_checkpoint.py", 4, tmp_path)
    _run_case("case_checkpoint_reshard.py", 2, tmp_path)
    _run_case("case_checkpoint_single.py", 1, tmp_path)
