"""The accelerator table MFU and the planner divide by."""

import pytest

from torchacc import hardware


def test_device_kinds_map_to_their_part():
    assert hardware.from_device_kind("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert hardware.from_device_kind("NVIDIA H100 PCIe").name == "h100-pcie"
    assert hardware.from_device_kind("NVIDIA H200").name == "h200"
    assert hardware.from_device_kind("NVIDIA A100-SXM4-80GB").name == "a100"
    assert hardware.from_device_kind("cpu") is None


def test_h100_peak_is_the_datasheet_figure():
    h100 = hardware.lookup("H100")
    assert h100.peak("bf16") == pytest.approx(989.4e12)
    assert h100.hbm_bw == pytest.approx(3.35e12)
    assert hardware.mfu(494.7e12, h100.peak()) == pytest.approx(0.5)
    assert hardware.mfu(1e12, None) is None


def test_unknown_names_are_refused_by_name():
    with pytest.raises(ValueError, match="'tpu-v9'"):
        hardware.lookup("tpu-v9")
    with pytest.raises(ValueError, match="'int4'"):
        hardware.lookup("a100").peak("int4")
