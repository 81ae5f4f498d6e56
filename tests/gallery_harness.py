"""Helpers for the launcher/gallery tests: run the launcher or a worker module in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from conftest import eager_device_type

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch_single_task.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Variables that would make a child think it is already a worker of some other job.
_WORKER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHACC_COMPILER_OPT",
    "TORCHACC_KERNEL_OPT",
)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _WORKER_VARS and not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL"))
    }
    env["OMP_NUM_THREADS"] = "1"  # the test machine has few cores; workers share them
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _run(cmd, env, timeout, expect_rc):
    p = subprocess.run(
        cmd, cwd=ROOT, env=child_env(env), capture_output=True, text=True, timeout=timeout
    )
    if expect_rc is not None and p.returncode != expect_rc:
        raise AssertionError(
            f"{' '.join(map(str, cmd))}\nexit code {p.returncode} (expected {expect_rc})\n"
            f"--- stdout\n{p.stdout[-8000:]}\n--- stderr\n{p.stderr[-8000:]}"
        )
    return p


def run_launcher(*flags, env=None, timeout=240, expect_rc=0) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(LAUNCHER), *map(str, flags)], env, timeout, expect_rc)


def run_module(module, *flags, env=None, timeout=240, expect_rc=0) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", module, *map(str, flags)], env, timeout, expect_rc)


def load_metrics(path) -> dict:
    with open(path) as f:
        return json.load(f)


def check_metrics(m: dict, steps: int, world_size: int, start: int = 0) -> None:
    """The --output JSON of a finished eager run has what the README promises (peak memory from
    torch's CUDA allocator on a GPU machine, the process's peak RSS on a CPU one)."""
    assert m["steps"] == list(range(start, start + steps))
    assert len(m["losses"]) == steps and all(math.isfinite(x) for x in m["losses"])
    assert len(m["step_times"]) == steps and all(t > 0 for t in m["step_times"])
    assert len(m["samples_per_sec"]) == steps
    assert m["config"]["world_size"] == world_size
    s = m["summary"]
    assert s["steps_run"] == steps and s["world_size"] == world_size
    assert s["final_loss"] == m["losses"][-1]
    assert s["peak_mem_gib"] > 0
    assert s["peak_mem_source"] == ("cuda" if eager_device_type() == "cuda" else "host_rss")
    assert s["steady_samples_per_sec"] > 0 and s["first_step_time_s"] > 0
    assert m["intervals"] and m["intervals"][-1]["step"] == start + steps
