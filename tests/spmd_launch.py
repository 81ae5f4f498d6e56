"""Running SPMD tests in fresh processes (shared by tests/test_spmd*.py and test_parallel.py).

The device count of a process (``CPU_NUM_DEVICES``, torch_xla's variable) must be set before
JAX starts, and SPMD mode is for the whole process, so the SPMD cases run out of the pytest
process: a case file of ``tests/spmd_cases/`` under its own pytest, a script under torchrun
(2 processes x 2 devices), or the gallery launcher.
"""

from __future__ import annotations

import json
import os
import sys

import prewarmed
from distributed_launch import env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CASES = os.path.join(HERE, "spmd_cases")


def _run(cmd, env, timeout):
    """``cmd`` in a session of its own; on timeout every process of it (torchrun's workers
    too) is killed by process group, then the timeout is raised: nothing hangs or lingers."""
    return prewarmed.fresh(cmd, env, REPO, timeout)


def run_cases(name, devices=4, extra_env=None, timeout=600):
    """Run ``spmd_cases/<name>`` under pytest with ``devices`` CPU devices; its stdout."""
    case_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    case_env.update({k: str(v) for k, v in (extra_env or {}).items()})
    cmd = ["-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider"]
    # Note [Pre-warmed test processes] in tests/prewarmed.py
    proc = prewarmed.run(
        [*cmd, "-p", "no:xdist", os.path.join(CASES, name)], case_env, REPO, timeout
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


def torchrun_case(script, *args, devices=2, timeout=400):
    """``spmd_cases/<script> args`` as a torchrun job of 2 processes x ``devices`` devices."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        os.path.join(CASES, script),
        *map(str, args),
    ]
    return _run(cmd, env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=devices), timeout)


def launch_gpt_tiny(tmp_path, name, *flags, **env_extra):
    """4 steps of gpt-tiny (fp32, batch 8) through the launcher: (process, its --output JSON)."""
    out = tmp_path / f"{name}.json"
    proc = _run(
        [
            sys.executable,
            "launch_single_task.py",
            "--nproc_per_node=1",
            "--model=gpt-tiny",
            "--batch_size=8",
            "--max_steps=4",
            "--amp_level=O0",
            f"--output={out}",
            *flags,
        ],
        env(TORCHACC_CACHE_DIR="off", **env_extra),
        300,
    )
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)
