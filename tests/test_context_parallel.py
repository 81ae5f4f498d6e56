"""torchacc.ops.context_parallel (Ulysses, ring attention, split/gather) on 4 CPU devices.

The cases live in tests/spmd_cases/case_context_parallel.py and run in a fresh process: the
device count must be set before JAX starts, and SPMD mode is for the whole process.
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.xdist_group("spmd_context_parallel")
def test_context_parallel_cases_on_4_devices():
    out = run_cases("case_context_parallel.py")
    assert " passed" in out and "failed" not in out
