"""Autocast on the torchacc device: CUDA autocast's dtype policy per op family, bf16 and fp16,
``autocast()`` with no arguments, and gradients through the casts."""

import pytest
import torch
import torch.nn.functional as F

import torchacc
from torchacc import amp
from torchacc.amp import autocast, autocast_policy

LOW = ["bf16", "fp16"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _t(*shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape))
    return torch.rand(*shape, generator=g).add_(0.5).to(dtype).to(torchacc.device())


# op family -> (callable, expected output dtype: "low" = the autocast dtype, or a dtype)
def _cases():
    a, b, v = _t(4, 4), _t(4, 4), _t(4)
    x3, img, w = _t(2, 4, 4), _t(1, 2, 5, 5), _t(3, 2, 3, 3)
    h = _t(4, 4, dtype=torch.float16)
    target = torch.tensor([0, 1, 2, 3]).to(torchacc.device())
    return {
        # lower precision: matmuls, linear, convolution, attention
        "mm": (lambda: torch.mm(a, b), "low"),
        "matmul": (lambda: a @ b, "low"),
        "bmm": (lambda: torch.bmm(x3, x3), "low"),
        "addmm": (lambda: torch.addmm(v, a, b), "low"),
        "baddbmm": (lambda: torch.baddbmm(x3, x3, x3), "low"),
        "mv": (lambda: torch.mv(a, v), "low"),
        "linear": (lambda: F.linear(a, b, v), "low"),
        "einsum": (lambda: torch.einsum("ij,jk->ik", a, b), "low"),
        "conv2d": (lambda: F.conv2d(img, w), "low"),
        "sdpa": (lambda: F.scaled_dot_product_attention(x3, x3, x3), "low"),
        # float32: pointwise transcendental, softmax, norms, losses, reductions
        "exp": (lambda: torch.exp(h), torch.float32),
        "log": (lambda: torch.log(h), torch.float32),
        "pow": (lambda: torch.pow(h, 2), torch.float32),
        "rsqrt": (lambda: torch.rsqrt(h), torch.float32),
        "softmax": (lambda: torch.softmax(h, -1), torch.float32),
        "log_softmax": (lambda: F.log_softmax(h, -1), torch.float32),
        "layer_norm": (lambda: F.layer_norm(h, (4,)), torch.float32),
        "group_norm": (lambda: F.group_norm(h.view(1, 4, 4), 2), torch.float32),
        "nll_loss": (lambda: F.nll_loss(h, target), torch.float32),
        "cross_entropy": (lambda: F.cross_entropy(h, target), torch.float32),
        "mse_loss": (lambda: F.mse_loss(h, h), torch.float32),
        "l1_loss": (lambda: F.l1_loss(h, h), torch.float32),
        "bce_logits": (lambda: F.binary_cross_entropy_with_logits(h, h), torch.float32),
        "sum": (lambda: h.sum(), torch.float32),
        "sum_dim": (lambda: h.sum(1), torch.float32),
        "prod": (lambda: h.prod(), torch.float32),
        "cumsum": (lambda: h.cumsum(0), torch.float32),
        "norm": (lambda: h.norm(), torch.float32),
        "vector_norm": (lambda: torch.linalg.vector_norm(h), torch.float32),
        "logsumexp": (lambda: torch.logsumexp(h, 1), torch.float32),
        # explicit dtype wins over fp32_set_opt_dtype
        "sum_dtype": (lambda: h.sum(dtype=torch.float16), torch.float16),
        # promote: widest input
        "addcmul": (lambda: torch.addcmul(a, h, h), torch.float32),
        "addcdiv": (lambda: torch.addcdiv(h, h, a), torch.float32),
        "dot": (lambda: torch.dot(h[0], v), torch.float32),
        "cat": (lambda: torch.cat([a, h]), torch.float32),
        "stack": (lambda: torch.stack([a, h]), torch.float32),
        # no policy: the input dtype
        "relu": (lambda: F.relu(h), torch.float16),
        "add": (lambda: h + h, torch.float16),
        "add_fp32": (lambda: a + a, torch.float32),
        "max": (lambda: h.max(), torch.float16),
    }


@pytest.mark.parametrize("low", LOW)
def test_policy_output_dtypes(low):
    dtype = DTYPES[low]
    wrong = {}
    with autocast(dtype=dtype):
        for name, (fn, want) in _cases().items():
            got = fn().dtype
            expected = dtype if want == "low" else want
            if got != expected:
                wrong[name] = (got, expected)
    assert not wrong, f"autocast({low}) dtypes (got, expected): {wrong}"


def test_policy_matches_cuda_lists():
    aten = torch.ops.aten
    assert autocast_policy.policy_of(aten.mm.default) == "lower_precision_fp"
    assert autocast_policy.policy_of(aten.convolution.default) == "lower_precision_fp"
    assert autocast_policy.policy_of(aten.native_layer_norm.default) == "fp32"
    assert autocast_policy.policy_of(aten.softmax.int) == "fp32_set_opt_dtype"
    assert autocast_policy.policy_of(aten.norm.Scalar) == "fp32_append_dtype"
    assert autocast_policy.policy_of(aten.addcmul.default) == "promote"
    assert autocast_policy.policy_of(aten.binary_cross_entropy.default) == "banned"
    assert autocast_policy.policy_of(aten.relu.default) is None


def test_no_argument_autocast_uses_device_and_default_dtype(monkeypatch):
    a = _t(4, 4)
    with autocast():
        assert torch.is_autocast_enabled("torchacc")
        assert (a @ a).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("torchacc")
    monkeypatch.setenv("TORCHACC_AMP_DTYPE", "fp16")
    with autocast():
        assert (a @ a).dtype == torch.float16
    monkeypatch.delenv("TORCHACC_AMP_DTYPE")
    amp.set_default_dtype(torch.bfloat16)
    try:
        with autocast():
            assert (a @ a).dtype == torch.bfloat16
    finally:
        amp.set_default_dtype(None)
    with autocast(enabled=False):
        assert (a @ a).dtype == torch.float32
    with autocast(True):  # torch.cuda.amp.autocast's positional form
        assert (a @ a).dtype == torch.bfloat16
    with autocast(torchacc.device(), dtype=torch.float16):  # torch_xla's form
        assert (a @ a).dtype == torch.float16
    with autocast("xla"):
        assert (a @ a).dtype == torch.bfloat16


def test_plain_torch_autocast_works_on_the_device():
    a = _t(4, 4)
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16
        assert torch.softmax(a.to(torch.bfloat16), 0).dtype == torch.float32


def test_cpu_tensors_and_float64_are_not_cast():
    with autocast(dtype=torch.bfloat16):
        c = torch.rand(3, 3)
        assert (c @ c).dtype == torch.float32  # a CPU op: not our autocast
        d = _t(3, 3, dtype=torch.float64)
        assert (d @ d).dtype == torch.float64


def test_binary_cross_entropy_is_banned_like_cuda():
    p = torch.sigmoid(_t(4))
    with autocast(dtype=torch.float16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, p)


@pytest.mark.parametrize("low", LOW)
def test_gradients_flow_through_casts(low):
    dtype = DTYPES[low]
    g = torch.Generator().manual_seed(0)
    w_cpu = torch.randn(5, 3, generator=g)
    x_cpu = torch.randn(4, 3, generator=g)
    y_cpu = torch.randint(0, 5, (4,), generator=g)
    w = w_cpu.clone().to(torchacc.device()).requires_grad_()
    with autocast(dtype=dtype):
        logits = F.linear(x_cpu.to(torchacc.device()), w)
        loss = F.cross_entropy(logits, y_cpu.to(torchacc.device()))
    loss.backward()
    assert logits.dtype == dtype and loss.dtype == torch.float32
    assert w.grad.dtype == torch.float32
    wr = w_cpu.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        ref = F.cross_entropy(F.linear(x_cpu, wr), y_cpu)
    ref.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref.detach(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.cpu(), wr.grad, rtol=5e-2, atol=2e-2)
