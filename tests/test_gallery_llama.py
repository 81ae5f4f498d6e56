"""gallery/llama and --kernel-opt: the LLaMA-style model, the torchacc_ops swap in the gallery
models, and --compiler-opt --kernel-opt training through the launcher like eager --kernel-opt."""

from __future__ import annotations

import pytest
import torch
from gallery_harness import load_metrics, run_launcher

import torchacc
import torchacc_ops
from gallery.gpt.main import lm_loss_fn
from gallery.gpt.model import build_gpt
from gallery.llama.model import CONFIGS, LLAMA_1B_NUM_PARAMS, build_llama
from torchacc import metrics

DEV = torchacc.device()


def test_llama_configs():
    with torch.device("meta"):
        model = build_llama("llama-1b")
    assert sum(p.numel() for p in model.parameters()) == LLAMA_1B_NUM_PARAMS
    cfg = CONFIGS["llama-1b"]
    assert cfg.n_kv_head < cfg.n_head and cfg.n_embd // cfg.n_head == 64  # GQA, cuDNN head dim
    from torchacc import launch_args

    names = {k for k, v in launch_args.MODELS.items() if v == "gallery.llama.main"}
    assert names == set(CONFIGS)


def _step(model, loss_fn, device, idx, tgt):
    model = model.to(device)
    loss = loss_fn(model(idx.to(device)), tgt.to(device))
    loss.backward()
    if device == DEV:
        torchacc.sync()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def _pair(build, name, seed=0):
    torch.manual_seed(seed)
    plain = build(name)
    kernels = build(name, kernels=True)
    kernels.load_state_dict(plain.state_dict())
    return plain, kernels


def _tokens(vocab, b=2, t=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(
        0, vocab, (b, t), generator=g
    )


@pytest.mark.parametrize("build, name", [(build_llama, "llama-tiny"), (build_gpt, "gpt-tiny")])
def test_kernel_models_compute_what_plain_pytorch_computes(build, name):
    """--kernel-opt swaps the layers, not the function: eager CPU, same weights, same loss and
    gradients (float32: only rounding differs)."""
    plain, kernels = _pair(build, name)
    assert kernels.kernels and not plain.kernels
    idx, tgt = _tokens(512)
    want = _step(plain, lm_loss_fn(False), "cpu", idx, tgt)
    got = _step(kernels, lm_loss_fn(True), "cpu", idx, tgt)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-4, atol=1e-6, msg=n)


def _recorded_ops(model, loss_fn, idx, tgt):
    torchacc.sync()
    metrics.clear_all()
    loss, grads = _step(model, loss_fn, DEV, idx, tgt)
    return metrics.counter_value("RecordedOps"), loss, grads


def test_llama_tiny_kernels_on_torchacc_match_eager_and_record_fewer_ops():
    """On the torchacc device the kernel model records fewer ops per step (forward + backward)
    than the plain one, and both match eager CPU."""
    plain, kernels = _pair(build_llama, "llama-tiny", seed=2)
    idx, tgt = _tokens(512, seed=3)
    want = _step(_pair(build_llama, "llama-tiny", seed=2)[0], lm_loss_fn(False), "cpu", idx, tgt)
    n_plain, loss_p, _ = _recorded_ops(plain, lm_loss_fn(False), idx, tgt)
    n_kern, loss_k, grads_k = _recorded_ops(kernels, lm_loss_fn(True), idx, tgt)
    assert n_kern < 0.8 * n_plain, (n_kern, n_plain)  # measured: 109 vs 290 ops
    torch.testing.assert_close(loss_p, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_k, want[0], rtol=1e-5, atol=1e-6)
    for n in want[1]:
        torch.testing.assert_close(grads_k[n], want[1][n], rtol=1e-4, atol=1e-6, msg=n)


# The compiler path with --kernel-opt against eager --kernel-opt, both float32 (O0): the same
# model and kernels' semantics, so only summation order differs (measured: relative loss
# differences 0, 0, 7.6e-8 over 3 steps). 1e-4, as the gallery's O0 parity test for GPT, catches a
# wrong gradient (AdamW's first step moves every weight by ~lr whatever the gradient's scale, but
# the sign and the second step's loss follow the gradient).
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_tiny_compiler_kernel_opt_matches_eager_kernel_opt(tmp_path):
    common = ["--model=llama-tiny", "--seq_len=16", "--batch_size=2", "--max_steps=3"]
    common += ["--log_interval=1", "--amp_level=O0", "--kernel-opt"]
    eager, acc = tmp_path / "eager.json", tmp_path / "acc.json"
    run_launcher(*common, f"--output={eager}", timeout=300)
    p = run_launcher(*common, "--compiler-opt", f"--output={acc}", timeout=540)
    assert "kernels torchacc_ops" in p.stdout and "[summary] llama-tiny torchacc x1" in p.stdout
    e, a = load_metrics(eager)["losses"], load_metrics(acc)["losses"]
    assert len(e) == len(a) == 3
    for i, (x, y) in enumerate(zip(a, e)):
        assert abs(x - y) <= 1e-4 * abs(y), (i, a, e)
    assert a[0] != a[1]  # it trained


def test_eager_path_does_not_import_torchacc():
    """--kernel-opt on the eager path imports torchacc_ops and the gallery models, never the
    compiler core (JAX stays out of eager runs)."""
    import subprocess
    import sys

    from gallery_harness import ROOT, child_env

    code = (
        "import sys, torch, torchacc_ops, gallery.llama.model, gallery.gpt.main\n"
        "from gallery.llama.model import build_llama\n"
        "m = build_llama('llama-tiny', kernels=True)\n"
        "m(torch.zeros(1, 8, dtype=torch.long)).sum().backward()\n"
        "assert 'torchacc' not in sys.modules and 'jax' not in sys.modules, sorted(sys.modules)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert torchacc_ops.__name__ == "torchacc_ops"
