"""Megatron tensor parallelism (``Config.dist.tp``, torch's ``parallelize_module`` plans) on 4
CPU devices: the cases live in tests/spmd_cases/case_tensor_parallel.py and run in a fresh
process (the device count must be set before JAX starts; SPMD mode is for the whole process)."""

import pytest
from spmd_launch import run_cases


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_tensor_parallel")
def test_tensor_parallel_cases_on_4_devices():
    out = run_cases("case_tensor_parallel.py")
    assert " passed" in out and "failed" not in out and "skipped" not in out
