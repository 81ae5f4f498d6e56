"""torchacc.parallel (MindSpore-style parallel modes) on 4 CPU devices.

The cases live in tests/spmd_cases/case_parallel.py and run in one fresh process: the device
count (``CPU_NUM_DEVICES=4``) must be set before JAX starts, and SPMD mode is for the whole
process.
"""

import pytest

from test_spmd import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_parallel")
def test_parallel_cases_on_4_devices():
    out = run_cases("case_parallel.py")
    assert " passed" in out and "failed" not in out
