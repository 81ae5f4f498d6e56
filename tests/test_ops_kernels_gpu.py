"""torchacc_ops on XLA:GPU (``pytest -m gpu`` on a GPU machine; skipped elsewhere).

Each check runs tests/kernels_gpu_worker.py in a subprocess where JAX may use the GPU (this
session pins JAX to the CPU, tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import cuda_device_count
from gallery_harness import ROOT, child_env

WORKER = ROOT / "tests" / "kernels_gpu_worker.py"


def gpu_test(fn):
    fn = pytest.mark.skipif(not cuda_device_count(), reason="no NVIDIA GPU visible to torch")(fn)
    return pytest.mark.gpu(pytest.mark.timeout(600)(fn))


# bf16 attention on both sides: cuDNN and CUDA's flash kernel each round once to bf16 from fp32
# accumulators, so outputs and gradients differ by a few bf16 ulps of their largest entry.
BF16_REL = 2e-2


def _run(case, device="cuda"):
    if device == "cuda":
        env = child_env({"TORCHACC_DEVICE": "gpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        env.pop("JAX_PLATFORMS", None)
    else:
        env = child_env({"JAX_PLATFORMS": "cpu"})
    p = subprocess.run(
        [sys.executable, str(WORKER), case, "--device", device],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert p.returncode == 0, p.stderr[-6000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    if "skip" in r:
        pytest.skip(r["skip"])
    return r


@gpu_test
@pytest.mark.parametrize("case", ["attention-bf16-causal", "attention-bf16-gqa"])
def test_bf16_causal_attention_takes_cudnn_and_matches_cuda_sdpa(case):
    r = _run(case)
    assert r["counters"] == {"FusedAttentionCudnn": 1, "FusedAttentionBackwardCudnn": 1}, r
    assert max(r["rel_diffs"]) <= BF16_REL, r
    assert r["fmha_forward_calls"] >= 1 and r["fmha_backward_calls"] == 1, r


@gpu_test
def test_fp32_attention_takes_the_xla_fallback():
    r = _run("attention-fp32")
    assert r["counters"] == {
        "FusedAttentionXlaFallback:dtype": 1,
        "FusedAttentionBackwardXlaFallback:dtype": 1,
    }, r
    assert max(r["rel_diffs"]) <= 1e-3, r  # fp32 both sides (TF32 may be on in cuDNN/XLA)
    assert r["fmha_forward_calls"] == r["fmha_backward_calls"] == 0, r


@gpu_test
def test_chunked_cross_entropy_needs_no_float32_logits_on_gpu():
    r = _run("cross-entropy-memory")
    assert r["chunked_temp"] < r["f32_logits"] / 4, r  # plain_temp is reported for comparison


def test_worker_on_cpu():
    """The same worker, eager CPU vs XLA:CPU, so it cannot rot where there is no GPU."""
    r = _run("attention-bf16-gqa", device="cpu")
    assert r["counters"] == {
        "FusedAttentionXlaFallback:platform": 1,
        "FusedAttentionBackwardXlaFallback:platform": 1,
    }, r
    assert max(r["rel_diffs"]) <= BF16_REL, r
    assert r["fmha_forward_calls"] == r["fmha_backward_calls"] == 0, r
