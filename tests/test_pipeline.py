"""Pipeline parallel (``ta.dist.PipelineParallel``, torchacc/pipeline/) against the eager model.

The SPMD cases live in tests/spmd_cases/case_pipeline.py and run in one fresh process with 4 CPU
devices (the device count must be set before JAX starts, and SPMD mode is for the whole
process).
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_pipeline")
def test_pipeline_cases_on_4_devices():
    out = run_cases("case_pipeline.py")
    assert " passed" in out and "failed" not in out
