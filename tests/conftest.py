import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "torchacc")
os.environ.setdefault("TORCHACC_CACHE_DIR", _CACHE)


def cuda_device_count() -> int:
    """GPUs eager PyTorch sees here (0 on a CPU machine). Uses NVML, so CUDA is not initialized
    in the pytest process."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def eager_device_type() -> str:
    """Where the gallery's eager path (and eager PyTorch in a subprocess) runs: cuda or cpu."""
    return "cuda" if cuda_device_count() else "cpu"


def skip_unless_devices(nproc: int, what: str = "eager processes") -> None:
    """Skip a test that starts ``nproc`` processes of one device each when this machine has GPUs
    but fewer than ``nproc`` (on a CPU machine every process computes on the CPU)."""
    n = cuda_device_count()
    if n and n < nproc:
        pytest.skip(f"needs {nproc} GPUs for {nproc} {what}, this machine has {n}")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("devices")
    if marker is not None:
        skip_unless_devices(*marker.args, **marker.kwargs)
