"""torchacc_ops: every kernel's forward and gradients against a float64 reference written here in
plain torch, on the torchacc device (one recorded op each way) and on plain CPU tensors (the eager
path); which attention implementation each call picks and that it is counted in metrics."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from compile_counts import new_graphs

import torchacc
import torchacc_ops
from torchacc import metrics
from torchacc.lowering import fused_attention, target
from torchacc.lowering import nn as lnn

DEV = torchacc.device()
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _run(fn, inputs, grads, device, seed=0):
    """fn(*inputs) on ``device``; returns the output and the gradients of the inputs flagged in
    ``grads`` for a random upstream gradient (so every gradient term matters)."""
    leaves = [
        None if t is None else t.detach().to(device).requires_grad_(g)
        for t, g in zip(inputs, grads)
    ]
    out = fn(*leaves)
    up = torch.randn(out.shape, generator=_gen(seed + 1), dtype=torch.float64)
    (out.double() * up.to(device)).sum().backward()
    return [out.detach().cpu()] + [t.grad.cpu() for t, g in zip(leaves, grads) if g]


def _check(fn, ref, inputs, grads, dtype=torch.float32, tol=None):
    """fn on torchacc and on CPU (eager) both match ref (float64, plain torch)."""
    tol = tol or TOL[dtype]
    cast = [None if t is None else (t.to(dtype) if t.is_floating_point() else t) for t in inputs]
    want = _run(ref, [None if t is None else _f64(t) for t in cast], grads, "cpu")
    for device in (DEV, "cpu"):
        got = _run(fn, cast, grads, device)
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == (cast[0].dtype if i == 0 else a.dtype)
            torch.testing.assert_close(a.double(), e, **tol, msg=f"{device} output {i}")


def _f64(t):
    return t.double() if t.is_floating_point() else t


# -------------------------------------------------------------------------------------------------
# attention


def ref_attention(q, k, v, mask=None, causal=False, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s.softmax(-1) @ v


def _qkv(B=2, H=4, Hkv=4, L=8, S=8, D=16, Dv=None, seed=0):
    g = _gen(seed)
    return (
        torch.randn(B, H, L, D, generator=g),
        torch.randn(B, Hkv, S, D, generator=g),
        torch.randn(B, Hkv, S, Dv or D, generator=g),
    )


def _bool_mask(shape, seed=3):
    m = torch.rand(shape, generator=_gen(seed)) > 0.4
    m[..., 0] = True  # no fully masked row (SDPA's math path gives NaN there)
    return m


ATTENTION_CASES = {
    "mha": (dict(), dict()),
    "causal": (dict(), dict(causal=True)),
    "gqa-causal": (dict(H=4, Hkv=2), dict(causal=True)),
    "mqa": (dict(H=4, Hkv=1, L=5, S=7), dict()),
    "cross-length-v-dim": (dict(L=6, S=10, Dv=8), dict(scale=0.3)),
    "bool-mask": (dict(H=4, Hkv=2), dict(mask=_bool_mask((2, 1, 8, 8)))),
    "bool-mask-causal": (dict(), dict(mask=_bool_mask((8, 8)), causal=True)),
    "additive-mask": (dict(), dict(mask=torch.randn(1, 4, 8, 8, generator=_gen(5)))),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_reference(case):
    shape, kw = ATTENTION_CASES[case]
    mask = kw.get("mask")
    causal, scale = kw.get("causal", False), kw.get("scale")
    mask_grad = mask is not None and mask.is_floating_point()

    def fn(q, k, v, m):
        return torchacc_ops.flash_attention(q, k, v, causal=causal, attn_mask=m, scale=scale)

    def ref(q, k, v, m):
        return ref_attention(q, k, v, m, causal, scale)

    _check(fn, ref, [*_qkv(**shape), mask], [True, True, True, mask_grad])


def test_attention_bf16_gqa_causal():
    def fn(q, k, v):
        return torchacc_ops.flash_attention(q, k, v, causal=True)

    def ref(q, k, v):
        return ref_attention(q, k, v, causal=True)

    _check(fn, ref, list(_qkv(H=4, Hkv=2, D=32)), [True] * 3, torch.bfloat16)


def test_sdpa_on_torchacc_is_one_fused_op_each_way():
    """F.scaled_dot_product_attention (GQA included) records torchacc.attention, and its backward
    torchacc.attention_backward: one op each way."""
    q, k, v = (t.to(DEV).requires_grad_() for t in _qkv(H=4, Hkv=2))
    torchacc.sync()
    metrics.clear_all()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out._st.value.node.op.rule.name == "torchacc.attention.default"
    torchacc.sync()
    assert metrics.counter_value("RecordedOps") == 1
    out.backward(torch.ones_like(out))
    for g in (q.grad, k.grad, v.grad):
        assert g._st.value.node.op.rule.name == "torchacc.attention_backward.default"
    with torch.no_grad():
        assert torchacc_ops.flash_attention(q, k, v).grad_fn is None


def test_attention_dropout_keeps_one_mask_for_forward_and_backward():
    """Dropout draws its keep mask from a seed the forward returns; rebuilt here from that seed,
    the reference with the same mask gives the same output and gradients."""
    p = 0.3
    q, k, v = _qkv(H=2, Hkv=1, L=6, S=6, D=8, seed=7)
    leaves = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    out = torchacc_ops.flash_attention(*leaves, causal=True, dropout_p=p)
    assert out._st.value.node.op.rule.name == "torchacc.attention_dropout.default"
    seed = out.grad_fn.saved_tensors[5]
    up = torch.randn(out.shape, generator=_gen(8))
    (out * up.to(DEV)).sum().backward()
    keep = lnn.keep_mask(lnn.dropout_key(jnp.asarray(int(seed.cpu()))), (2, 2, 6, 6), p)
    keep = torch.from_numpy(keep.__array__().copy())
    assert 0.4 < keep.float().mean() < 0.95
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    rq, rk, rv = ref_leaves
    s = rq @ rk.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    want = (s.softmax(-1) * keep / (1 - p)) @ rv.repeat_interleave(2, 1)
    (want * up.double()).sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), rtol=1e-5, atol=1e-5)
    for a, e in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.cpu().double(), e.grad, rtol=1e-5, atol=1e-5)


def test_eager_attention_dropout_runs_sdpa_dropout():
    q, k, v = _qkv(seed=9)
    torch.manual_seed(0)
    a = torchacc_ops.flash_attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(a, ref_attention(q, k, v).float())
    torch.manual_seed(0)
    torch.testing.assert_close(a, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))


# -------------------------------------------------------------------------------------------------
# which implementation each call picks


@pytest.mark.parametrize(
    "args, reason",
    [
        (("gpu", jnp.bfloat16, 64, 64, 128, 128, None, True, 0.0, False), None),
        (("gpu", jnp.float16, 128, 128, 64, 64, "bool", False, 0.0, False), None),
        (("cpu", jnp.bfloat16, 64, 64, 128, 128, None, True, 0.0, False), "platform"),
        (("gpu", jnp.float32, 64, 64, 128, 128, None, True, 0.0, False), "dtype"),
        (("gpu", jnp.bfloat16, 60, 60, 128, 128, None, True, 0.0, False), "head_dim"),
        (("gpu", jnp.bfloat16, 512, 512, 128, 128, None, True, 0.0, False), "head_dim"),
        (("gpu", jnp.bfloat16, 64, 32, 128, 128, None, False, 0.0, False), "v_head_dim"),
        (("gpu", jnp.bfloat16, 64, 64, 128, 128, None, True, 0.1, False), "dropout"),
        (("gpu", jnp.bfloat16, 64, 64, 64, 128, None, True, 0.0, False), "causal_cross"),
        (("gpu", jnp.bfloat16, 64, 64, 128, 128, "float", False, 0.0, True), "mask_grad"),
        (("gpu", jnp.bfloat16, 64, 64, 127, 128, "bool", False, 0.0, False), "mask_odd_length"),
    ],
)
def test_attention_choice(args, reason):
    assert fused_attention.choose(*args) == reason


def _attention_step(shape, **kw):
    q, k, v = (t.to(DEV).requires_grad_() for t in _qkv(**shape))
    out = torchacc_ops.flash_attention(q, k, v, **kw)
    out.sum().backward()
    torchacc.sync()
    return out.cpu(), q.grad.cpu()


def test_every_attention_call_is_counted_once_per_compile():
    torchacc.sync()  # nothing pending from an earlier test
    metrics.clear_all()
    for _ in range(2):  # the second step reuses the program: nothing is lowered again
        q, k, v = (t.to(DEV).requires_grad_() for t in _qkv(L=9, S=9))
        a = torchacc_ops.flash_attention(q, k, v)
        b = torchacc_ops.flash_attention(q, k, v, causal=True)
        (a + b).sum().backward()
        torchacc.sync()
    assert new_graphs() == 1
    assert metrics.counter_value("FusedAttentionXlaFallback:platform") == 2
    assert metrics.counter_value("FusedAttentionBackwardXlaFallback:platform") == 2
    assert metrics.counter_value("FusedAttentionCudnn") is None


def test_a_call_cudnn_refuses_falls_back_and_says_so():
    """Lowered 'for a GPU' on this CPU machine, cuDNN is chosen, refuses while tracing (no cuDNN
    here), and the call takes the XLA fallback with reason cudnn_rejected, numerics intact."""
    want = _attention_step(dict(L=10, S=10, D=24), causal=True)  # compiled for the CPU
    metrics.clear_all()
    target.set_platform_resolver(lambda: "gpu")
    try:
        shape = dict(L=10, S=10, D=24)
        q, k, v = (t.to(DEV).to(torch.bfloat16).requires_grad_() for t in _qkv(**shape))
        out = torchacc_ops.flash_attention(q, k, v, causal=True)
        out.float().sum().backward()
        torchacc.sync()
    finally:
        from torchacc.runtime import device

        target.set_platform_resolver(device.platform)
    assert metrics.counter_value("FusedAttentionXlaFallback:cudnn_rejected") == 1
    assert metrics.counter_value("FusedAttentionBackwardXlaFallback:cudnn_rejected") == 1
    torch.testing.assert_close(out.float().cpu(), want[0], rtol=2e-2, atol=2e-2)


def test_fallback_can_be_forced(monkeypatch):
    # an earlier test's pending attention (e.g. in garbage not collected yet) must not be
    # compiled under the forced fallback and counted here
    torchacc.sync()
    monkeypatch.setenv("TORCHACC_FUSED_ATTENTION", "xla")
    metrics.clear_all()
    _attention_step(dict(L=11, S=11, D=8))
    assert metrics.counter_value("FusedAttentionXlaFallback:disabled") == 1


def test_attention_bad_input_names_the_problem():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="4-d"):
        torchacc_ops.flash_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="multiple"):
        torchacc_ops.flash_attention(q, k[:, :3], v[:, :3])
    qd, kd, vd = q.to(DEV), k.to(DEV), v.to(DEV)
    with pytest.raises(RuntimeError, match="torchacc.attention: q, k and v must have one"):
        torchacc_ops.flash_attention(qd, kd.double(), vd)
    with pytest.raises(RuntimeError, match=r"mask must broadcast to \(batch, heads, L, S\)"):
        torchacc_ops.flash_attention(qd, kd, vd, attn_mask=torch.ones(3, 8, dtype=bool).to(DEV))


# -------------------------------------------------------------------------------------------------
# RMSNorm, rotary embedding, SwiGLU


def ref_rms_norm(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_matches_reference(dtype, weight):
    g = _gen(11)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(16, generator=g) if weight else None
    eps = 1e-5
    _check(
        lambda x, w: torchacc_ops.rms_norm(x, w, eps),
        lambda x, w: ref_rms_norm(x, w, eps),
        [x, w],
        [True, weight],
        dtype,
    )


def test_rms_norm_is_one_op_each_way_and_routes_f_rms_norm():
    x = torch.randn(4, 8).to(DEV).requires_grad_()
    w = torch.randn(8).to(DEV).requires_grad_()
    torchacc.sync()
    metrics.clear_all()
    out = F.rms_norm(x, (8,), w)
    assert out._st.value.node.op.rule.name == "torchacc.rms_norm.default"
    torchacc.sync()
    assert metrics.counter_value("RecordedOps") == 1
    out.backward(torch.ones_like(out))
    assert x.grad._st.value.node.op.rule.name == "torchacc.rms_norm_backward.default"
    assert w.grad._st.value.node.op.rule.name == "torchacc.rms_norm_backward.default"
    # eps=None is the dtype's epsilon, as F.rms_norm on CPU
    xc = torch.randn(4, 8) * 1e-4
    torch.testing.assert_close(torchacc_ops.rms_norm(xc.to(DEV)).cpu(), F.rms_norm(xc, (8,)))


def ref_rotary(x, cos, sin):
    if cos.shape[-1] != x.shape[-1]:
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


@pytest.mark.parametrize("half", [True, False], ids=["half-dim", "full-dim"])
@pytest.mark.parametrize("table_grad", [False, True])
def test_rotary_matches_reference(half, table_grad):
    g = _gen(13)
    x = torch.randn(2, 3, 6, 8, generator=g)
    cos, sin = (torch.randn(6, 4 if half else 8, generator=g) for _ in range(2))
    _check(torchacc_ops.apply_rotary_emb, ref_rotary, [x, cos, sin], [True] + [table_grad] * 2)


def test_rotary_tables_and_bf16():
    cos, sin = torchacc_ops.rotary_cos_sin(6, 8)
    assert cos.shape == (6, 4)
    torch.testing.assert_close(cos[3, 1], torch.tensor(math.cos(3 * 10000 ** (-2 / 8))))
    x = torch.randn(2, 2, 6, 8, generator=_gen(14))
    _check(torchacc_ops.apply_rotary_emb, ref_rotary, [x, cos, sin], [True, False, False],
           torch.bfloat16)  # fmt: skip


def ref_swiglu(a, b):
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(dtype):
    g = _gen(15)
    a, b = torch.randn(3, 4, 10, generator=g) * 3, torch.randn(3, 4, 10, generator=g)
    _check(torchacc_ops.swiglu, ref_swiglu, [a, b], [True, True], dtype)


def test_rotary_and_swiglu_are_one_op_each_way():
    x = torch.randn(2, 6, 8).to(DEV).requires_grad_()
    cos, sin = (t.to(DEV) for t in torchacc_ops.rotary_cos_sin(6, 8))
    up = torch.randn(2, 6, 8).to(DEV).requires_grad_()
    torchacc.sync()
    metrics.clear_all()
    out = torchacc_ops.swiglu(torchacc_ops.apply_rotary_emb(x, cos, sin), up)
    torchacc.sync()
    assert metrics.counter_value("RecordedOps") == 2
    out.backward(torch.ones_like(out))
    assert up.grad._st.value.node.op.rule.name == "torchacc.swiglu_backward.default"
    assert x.grad._st.value.node.op.rule.name == "torchacc.rotary_backward.default"


def test_bad_input_names_the_problem():
    x = torch.randn(2, 6, 8).to(DEV)
    with pytest.raises(RuntimeError, match="torchacc.rotary: .*head_dim"):
        torchacc_ops.apply_rotary_emb(x, torch.ones(6, 3).to(DEV), torch.ones(6, 3).to(DEV))
    with pytest.raises(ValueError, match="apply_rotary_emb"):
        torchacc_ops.apply_rotary_emb(x.cpu(), torch.ones(6, 3), torch.ones(6, 3))
    with pytest.raises(RuntimeError, match="torchacc.swiglu: gate and up"):
        torchacc_ops.swiglu(x, x[..., :4])
    with pytest.raises(RuntimeError, match=r"torchacc.cross_entropy: logits \(..., vocab\)"):
        torchacc_ops.cross_entropy(x, torch.zeros(2, 5, dtype=torch.long).to(DEV))
    with pytest.raises(ValueError, match="reduction 'avg'"):
        torchacc_ops.cross_entropy(x, torch.zeros(2, 6, dtype=torch.long).to(DEV), reduction="avg")


# -------------------------------------------------------------------------------------------------
# cross-entropy


def _ce_inputs(rows=10, vocab=12, seed=17):
    g = _gen(seed)
    logits = torch.randn(2, rows // 2, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (2, rows // 2), generator=g)
    target[0, 1] = target[1, 3] = -100
    return logits, target


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [0, 3], ids=["one-block", "blocks-of-3"])
def test_cross_entropy_matches_reference(reduction, smoothing, chunk):
    logits, target = _ce_inputs()

    def fn(x, t):
        return torchacc_ops.cross_entropy(
            x, t, reduction=reduction, label_smoothing=smoothing, chunk_rows=chunk
        )

    def ref(x, t):
        return F.cross_entropy(
            x.reshape(-1, 12), t.reshape(-1), reduction=reduction, label_smoothing=smoothing
        ).reshape(t.shape if reduction == "none" else ())

    _check(fn, ref, [logits, target], [True, False])


def test_cross_entropy_label_smoothing_bounds():
    """label_smoothing is a probability: 1.0 (a uniform target) is accepted and matches
    F.cross_entropy, loss and gradient; outside [0, 1] is an error naming the argument."""
    logits, target = _ce_inputs()
    x = logits.to(DEV).requires_grad_()
    loss = torchacc_ops.cross_entropy(x, target.to(DEV), label_smoothing=1.0)
    loss.backward()
    xr = logits.double().requires_grad_()
    want = F.cross_entropy(xr.reshape(-1, 12), target.reshape(-1), label_smoothing=1.0)
    want.backward()
    torch.testing.assert_close(loss.cpu().double(), want.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, rtol=2e-5, atol=2e-5)
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match=f"label_smoothing must be in \\[0, 1\\], got {bad}"):
            torchacc_ops.cross_entropy(x, target.to(DEV), label_smoothing=bad)


def test_cross_entropy_bf16_logits_keep_their_dtype():
    logits, target = _ce_inputs(rows=16, vocab=40)
    x = logits.to(torch.bfloat16).to(DEV).requires_grad_()
    with torch.autocast("torchacc", dtype=torch.bfloat16):  # no float32 cast of the logits
        loss = torchacc_ops.cross_entropy(x, target.to(DEV), chunk_rows=5)
    assert loss.dtype == torch.float32 and loss._st.value.node.op.rule.name.startswith(
        "torchacc.cross_entropy"
    )
    loss.backward()
    assert x.grad.dtype == torch.bfloat16
    xr = logits.to(torch.bfloat16).double().requires_grad_()
    want = F.cross_entropy(xr.reshape(-1, 40), target.reshape(-1))
    want.backward()
    torch.testing.assert_close(loss.cpu().double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, rtol=1e-2, atol=1e-4)


def test_cross_entropy_lowering_never_holds_float32_logits():
    """The program the chunked forward + backward emit for bf16 logits of 4096 x 1024 (chunks of
    256 rows) has no float32 value of the logits' size, only 256-row blocks; a plain
    log_softmax(x.float()) formulation has dozens. (Compiled, XLA:CPU still makes one float32 copy
    of the bf16 logits: its bf16 normalisation upcasts the slice; XLA:GPU keeps bf16 slices. The
    compiled scratch size on XLA:GPU is checked in tests/test_ops_kernels_gpu.py.)"""
    import jax

    from torchacc.lowering import fused

    rows, vocab = 4096, 1024
    x = jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((rows,), jnp.int64)

    def chunked(x, t):
        loss, lse = fused.cross_entropy(x, t, -100, 0.0, 1, 256)
        return loss, fused.cross_entropy_backward(jnp.float32(1), x, t, lse, -100, 0.0, 1, 256)

    def plain(x, t):
        def f(x):
            logp = jax.nn.log_softmax(x.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=-1))

        return jax.value_and_grad(f)(x)

    def count(fn, shape):
        return jax.jit(fn).lower(x, t).as_text().count(f"tensor<{shape}xf32>")

    assert count(chunked, "4096x1024") == 0 and count(chunked, "256x1024") > 0
    assert count(plain, "4096x1024") > 0


def test_attention_under_autocast_runs_in_the_autocast_dtype():
    q, k, v = _qkv(H=4, Hkv=2)
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        out = torchacc_ops.flash_attention(q.to(DEV), k.to(DEV), v.to(DEV), causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torchacc_ops.flash_attention(q, k, v, causal=True)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), want.float(), **TOL[torch.bfloat16])
