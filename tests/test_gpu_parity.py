"""XLA:GPU parity with eager CUDA for the core models (2 SGD steps, fp32, TF32 off both sides).

Each model runs in a subprocess (tests/gpu_parity_worker.py) where JAX may use the GPU: the test
session itself pins JAX to the CPU (tests/conftest.py). Skipped without an NVIDIA GPU, without a
JAX GPU backend, and (HF models) without transformers. ``test_worker_on_cpu`` runs the same
worker eager-CPU vs XLA:CPU so it cannot rot on machines without a GPU.
"""

from __future__ import annotations

import json

import prewarmed
import pytest
from conftest import cuda_device_count
from gallery_harness import ROOT, child_env

WORKER = ROOT / "tests" / "gpu_parity_worker.py"
MODELS = ["mlp", "cnn-bn", "gpt-sdpa", "hf-gpt2", "hf-bert", "hf-llama"]
LOSS_RTOL = 5e-5  # fp32 on both sides: only summation order differs
GRAD_TOL = 5e-4  # max |diff| / the parameter's largest gradient (see the worker's _grad_error)


def _run(model, device, env):
    p = prewarmed.run([str(WORKER), model, f"--device={device}"], env=env, cwd=ROOT, timeout=540)
    assert p.returncode == 0, p.stderr[-6000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _check(r):
    if "skip" in r:
        pytest.skip(r["skip"])
    assert r["fallbacks"] == [], r  # no CPU round trip inside the step
    for step, (a, e) in enumerate(zip(r["torchacc_losses"], r["eager_losses"], strict=True)):
        assert abs(a - e) <= LOSS_RTOL * abs(e), (step, r)
    assert r["grad_rel_error"] <= GRAD_TOL, r


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not cuda_device_count(), reason="no NVIDIA GPU visible to torch")
@pytest.mark.parametrize("model", MODELS)
def test_xla_gpu_matches_eager_cuda(model):
    env = child_env({"TORCHACC_DEVICE": "gpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    env.pop("JAX_PLATFORMS", None)  # the session's "cpu" pin must not reach the worker
    r = _run(model, "cuda", env)
    if "skip" not in r:
        assert r["platform"] == "gpu", r
    _check(r)


@pytest.mark.parametrize("model", ["mlp", pytest.param("hf-llama", marks=pytest.mark.slow)])
def test_worker_on_cpu(model):
    _check(_run(model, "cpu", child_env({"JAX_PLATFORMS": "cpu"})))
