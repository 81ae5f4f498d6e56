import os
import subprocess
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "torchacc")
os.environ.setdefault("TORCHACC_CACHE_DIR", _CACHE)

# XLA:CPU compiles (not the tests' own work) are most of the suite's time on a CPU machine. These
# flags make the CPU backend compile ~1.5x faster (measured on the 2-core box, backend compile of
# the narrow ResNet-50 step's two programs, same run: 33.4 s -> 21.8 s; an earlier pair 25.7 s ->
# 17.4 s) by skipping LLVM's optimizations of the generated machine code: the tests' tensors are
# tiny, so the code's speed does not matter, and every comparison is against eager PyTorch or
# against torchacc itself under the same flags. (Also switching off XLA:CPU's MLIR fusion
# emitters compiled 2.5x faster, but then the CNN + BatchNorm training tests drifted from eager
# by 1e-3 after a few steps where they match to 1e-5 with either change alone: not used.) Only
# on a machine without a GPU (the GPU backend would compile slower kernels), and only if this
# jaxlib knows the flags: XLA aborts at start-up on an unknown flag, so the controller probes
# once and its xdist workers and subprocesses inherit the result. TORCHACC_TEST_XLA_FLAGS=default
# keeps XLA's own settings.
FAST_CPU_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)


def _use_fast_cpu_compile_flags():
    if os.environ.get("TORCHACC_TEST_XLA_FLAGS") in ("default", "fast", "unknown"):
        return  # decided (by the controller, or by the user)
    decided = "unknown"
    if os.environ["JAX_PLATFORMS"] == "cpu" and not os.path.exists("/dev/nvidia0"):
        flags = " ".join([os.environ.get("XLA_FLAGS", ""), *FAST_CPU_COMPILE_FLAGS]).strip()
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            env=dict(os.environ, XLA_FLAGS=flags),
            capture_output=True,
            timeout=120,
        )
        if probe.returncode == 0:
            os.environ["XLA_FLAGS"] = flags
            decided = "fast"
    os.environ["TORCHACC_TEST_XLA_FLAGS"] = decided


_use_fast_cpu_compile_flags()


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


def pytest_terminal_summary(terminalreporter):
    """How many docs code blocks ran (tests/test_docs.py's pages, summed over xdist workers)."""
    ran = [
        value
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", ())
        if key == "docs_blocks_ran"
    ]
    if ran:
        terminalreporter.write_line(
            f"docs: {sum(ran)} python code blocks ran on {len(ran)} pages (tests/test_docs.py)"
        )


# --- where the suite's time goes -------------------------------------------------------------
# The suite is CPU-bound on 2 cores (about 1.9 busy), and most of a test's CPU is in the
# processes it starts, which pytest's --durations does not separate from waiting for a core.
# ``--cpu-times=PATH`` appends one line per test to PATH.<xdist worker>: node id, the test
# process's CPU seconds, its reaped children's CPU seconds, wall seconds (tab-separated).
# tools/suite_cpu.py sums them per file.


def pytest_configure(config):
    # pytest collects garbage 5 times when a session ends (to report unraisable exceptions). With
    # torch, JAX and a few hundred compiled programs alive each collection takes ~1 s, and every
    # case file run in its own pytest process (tests/spmd_launch.py) pays it too: collect once.
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # another pytest: its default
        return
    config.stash[gc_collect_iterations_key] = 1


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-times",
        default=None,
        metavar="PATH",
        help="append each test's CPU seconds (own, children's) and wall seconds to PATH.<worker>",
    )


def _cpu_seconds():
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-times")
    if not path:
        yield
        return
    import time

    own0, kids0 = _cpu_seconds()
    wall0 = time.perf_counter()
    yield
    own1, kids1 = _cpu_seconds()
    wall = time.perf_counter() - wall0
    # this session's own xdist worker id (a pytest started by a test inherits the env variable)
    worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
    with open(f"{path}.{worker}", "a") as f:
        f.write(f"{item.nodeid}\t{own1 - own0:.2f}\t{kids1 - kids0:.2f}\t{wall:.2f}\n")
