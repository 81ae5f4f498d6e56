"""SPMD sharding through XLA's partitioner on 4 CPU devices.

The cases live in tests/spmd_cases/ and run in a fresh process: the device count
(``CPU_NUM_DEVICES=4``, torch_xla's variable) must be set before JAX starts, and SPMD mode is
for the whole process.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_cases(name, devices=4, timeout=600):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
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
            os.path.join(HERE, "spmd_cases", name),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(HERE),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_sharding")
def test_sharding_cases_on_4_devices():
    out = run_cases("case_sharding.py")
    assert " passed" in out and "failed" not in out
