"""SPMD on the trace-once frontend (torchacc.compile over sharded tensors) on 4 CPU devices.

The cases live in tests/spmd_cases/case_trace_once.py and run in a fresh process: the device
count must be set before JAX starts, and SPMD mode is for the whole process.
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_trace_once")
def test_trace_once_sharded_cases_on_4_devices():
    out = run_cases("case_trace_once.py")
    assert " passed" in out and "failed" not in out
