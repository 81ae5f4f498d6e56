"""Manual regions (torch_xla's ``_shard_map`` / ``xs.shard_map``) on 4 CPU devices.

The cases live in tests/spmd_cases/case_regions.py and run in a fresh process with 4 CPU devices
(the device count must be set before JAX starts).
"""

import pytest
from spmd_launch import run_cases


@pytest.mark.xdist_group("spmd_regions")
def test_manual_region_cases_on_4_devices():
    out = run_cases("case_regions.py")
    assert "4 passed" in out and "failed" not in out
