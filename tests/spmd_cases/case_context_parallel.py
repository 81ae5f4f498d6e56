"""Context parallel on 4 CPU devices (run by tests/test_context_parallel.py, CPU_NUM_DEVICES=4).

``torchacc.ops.context_parallel``'s Ulysses and ring attention in SPMD style (sequence split on
the ``cp`` axis of a dp x cp mesh): output and dq/dk/dv against full eager attention, causal and
not, cp = 2 and 4; the split/gather helpers; a training step compiles once; bad input.
"""

import math
import os
import sys

import jax
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from compile_counts import new_graphs  # noqa: E402
from torchacc.ops import context_parallel as cp_ops  # noqa: E402

import torchacc  # noqa: E402

DEV = torchacc.device()


def eager_attention(q, k, v, causal, scale=None, q_lens=None, k_lens=None):
    """Full attention on CPU, [batch, seq, heads, head_dim]; with lengths, keys past a row's
    k_len are masked and queries past its q_len give 0."""
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if k_lens is not None:
        pad = torch.arange(k.shape[1])[None, :] >= torch.tensor(k_lens)[:, None]
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    if q_lens is not None:
        pad = torch.arange(q.shape[1])[None, :] >= torch.tensor(q_lens)[:, None]
        out = out.masked_fill(pad[:, :, None, None], 0.0)
    return out


def _qkv(seed, shape=(2, 16, 4, 8), kv_heads=None):
    g = torch.Generator().manual_seed(seed)
    kv_shape = (*shape[:2], kv_heads or shape[2], shape[3])
    return [torch.randn(*s, generator=g, requires_grad=True) for s in (shape, kv_shape, kv_shape)]


def _check(op, cp, causal, seed=0, kv_heads=None, softmax_scale=None, intra=None, lens=None):
    group = cp_ops.initialize_context_parallel(cp, intra)
    assert cp_ops.get_context_parallel_group() is group and group.size == cp
    q, k, v = _qkv(seed, kv_heads=kv_heads)
    q_lens, k_lens = lens or (None, None)
    want = eager_attention(q, k, v, causal, softmax_scale, q_lens, k_lens)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1))
    want.backward(grad_out)
    qd, kd, vd = (t.detach().to(DEV).requires_grad_() for t in (q, k, v))
    as_tensor = [None if x is None else torch.tensor(x).to(DEV) for x in (q_lens, k_lens)]
    out = op(qd, kd, vd, *as_tensor, softmax_scale=softmax_scale, causal=causal)
    out.backward(grad_out.to(DEV))
    torchacc.sync()
    for got, ref in ((out, want), (qd.grad, q.grad), (kd.grad, k.grad), (vd.grad, v.grad)):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.cpu(), ref.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", [cp_ops.ulysses, cp_ops.ring_attention], ids=["ulysses", "ring"])
def test_attention_and_grads_match_eager(op, cp, causal):
    _check(op, cp, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_2d_ulysses_inside_ring_across_matches_eager(causal):
    """cp = 4 as 2 intra (Ulysses) x 2 inter (ring), one region."""
    _check(cp_ops.context_parallel_2d, 4, causal, seed=5, intra=2)
    assert cp_ops.get_intra_cp_process_group().size == 2
    assert cp_ops.get_inter_cp_process_group().size == 2


def test_varlen_lengths_match_eager():
    """q_lens / k_lens: padding at the end of each row; keys past k_len masked, queries past
    q_len give 0 (and no gradient)."""
    _check(cp_ops.ring_attention, 4, True, seed=6, lens=([11, 16], [11, 16]))
    _check(cp_ops.ulysses, 2, False, seed=7, lens=([5, 16], [9, 16]))
    _check(cp_ops.context_parallel_2d, 4, True, seed=8, intra=2, lens=(None, [13, 7]))


@pytest.mark.parametrize("op", [cp_ops.ulysses, cp_ops.ring_attention], ids=["ulysses", "ring"])
def test_bf16_within_2e_2(op):
    """bf16 q/k/v (fp32 softmax inside): output and grads within 2e-2 of fp32 eager."""
    cp_ops.initialize_context_parallel(4)
    q, k, v = _qkv(9)
    want = eager_attention(q, k, v, True)
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(10))
    want.backward(grad_out)
    qd, kd, vd = (t.detach().bfloat16().to(DEV).requires_grad_() for t in (q, k, v))
    out = op(qd, kd, vd, causal=True)
    out.backward(grad_out.bfloat16().to(DEV))
    torchacc.sync()
    for got, ref in ((out, want), (qd.grad, q.grad), (kd.grad, k.grad), (vd.grad, v.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.cpu().float(), ref.detach(), atol=2e-2, rtol=2e-2)


def test_gqa_and_softmax_scale():
    _check(cp_ops.ring_attention, 2, True, seed=3, kv_heads=2, softmax_scale=0.3)
    _check(cp_ops.ulysses, 2, False, seed=4, kv_heads=2, softmax_scale=0.3)


def _compiled_hlo(fwd, shape=(2, 16, 4, 8)):
    arg = jax.ShapeDtypeStruct(shape, jax.numpy.float32)
    return jax.jit(fwd).lower(arg, arg, arg).compile().as_text()


def test_regions_use_jax_collectives_over_cp():
    """The ops really run split: Ulysses' program holds all-to-alls, ring's collective-permutes
    (K/V passed around the ring), and no device computes the full [seq, seq] scores."""
    group = cp_ops.initialize_context_parallel(4)
    q, k, v = (t.detach().to(DEV) for t in _qkv(0))
    cp_ops.ulysses(q, k, v, causal=True)
    cp_ops.ring_attention(q, k, v, causal=True)
    fns = {
        ("ring" if key[4] else "ulysses"): f
        for key, f in cp_ops._fns.items()
        if key[0] == "attention" and key[1] == id(group.mesh)
    }
    ulysses_hlo = _compiled_hlo(fns["ulysses"])
    ring_hlo = _compiled_hlo(fns["ring"])
    assert "all-to-all" in ulysses_hlo
    assert ring_hlo.count("collective-permute") >= 3 * (4 - 1)  # k, v, positions per hop
    # per device scores: [b, h, 16 / 4, 16 / 4] blocks, never [.., 16, 16]
    assert "f32[2,4,4,4]" in ring_hlo and "f32[2,4,16,16]" not in ring_hlo


def _temp_bytes(fn, mesh, seq, shape=(1, 512, 4, 16)):
    """Per-device temporary bytes of ``fn``'s compiled program (XLA's memory analysis), q/k/v
    split on ``seq``."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec(None, seq))
    arg = jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=sharding)
    return jax.jit(fn).lower(arg, arg, arg).compile().memory_analysis().temp_size_in_bytes


def _fwd_bwd(f):
    return lambda q, k, v: jax.vjp(f, q, k, v)[1](q)


def test_per_device_attention_bytes_shrink_by_cp():
    """Attention activations per device (forward, and forward + backward) are <= 1/cp + 10% of
    the unsharded program's, for Ulysses and the causal ring (XLA's memory analysis of the
    compiled program; the [seq, seq] scores dominate at seq 512)."""
    import numpy as np

    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "inter", "intra"))
    plain = cp_ops._make_attention(one, None, (), (), 0.25, True, False)
    base = [_temp_bytes(g, one, None) for g in (plain, _fwd_bwd(plain))]
    for cp in (2, 4):
        group = cp_ops.initialize_context_parallel(cp)
        axes = group.axes
        for a2a, ring in ((axes, ()), ((), axes)):
            f = cp_ops._make_attention(group.mesh, None, a2a, ring, 0.25, True, False)
            for g, full in zip((f, _fwd_bwd(f)), base):
                got = _temp_bytes(g, group.mesh, group.spec)
                assert got <= full * 1.1 / cp, (cp, a2a, ring, got, full)


def test_split_and_gather_helpers():
    group = cp_ops.initialize_context_parallel(4)
    x = torch.randn(2, 8, 3, requires_grad=True)
    xd = x.detach().to(DEV).requires_grad_()
    y = cp_ops.split_forward_gather_backward(xd, 1, group)
    z = cp_ops.gather_forward_split_backward(y * 2.0, dim=1)
    (z * z).sum().backward()
    ((x * 2.0) ** 2).sum().backward()
    torchacc.sync()
    torch.testing.assert_close(z.cpu(), (x * 2.0).detach(), atol=0, rtol=0)
    torch.testing.assert_close(xd.grad.cpu(), x.grad, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"dimension 2 of size 3 .*not divisible by cp=4"):
        cp_ops.split_forward_gather_backward(xd, 2)


def test_a_training_step_compiles_once():
    """A step with ring attention between two linears: losses equal eager's, no new program
    after step 2."""
    cp_ops.initialize_context_parallel(2)
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 24)
    model = torch.nn.Linear(8, 24)
    model.load_state_dict(ref.state_dict())
    model.to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    graphs, before = [], new_graphs()
    for step in range(4):
        x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(step))
        q, k, v = model(x.to(DEV)).view(2, 8, 3, 2, 4).unbind(2)
        loss = cp_ops.ring_attention(q, k, v, causal=True).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        graphs.append(new_graphs() - before)
        before += graphs[-1]
        rq, rk, rv = ref(x).view(2, 8, 3, 2, 4).unbind(2)
        want = eager_attention(rq, rk, rv, True).square().mean()
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        assert abs(loss.item() - want.item()) <= 1e-5, (step, loss.item(), want.item())
    assert graphs[2:] == [0, 0], graphs


def test_bad_input_is_one_value_error():
    cp_ops.initialize_context_parallel(4)
    q, k, v = (t.detach().to(DEV) for t in _qkv(0, shape=(2, 8, 2, 4)))
    with pytest.raises(ValueError, match=r"ulysses: q's 2 heads and k/v's 2 heads .* cp=4"):
        cp_ops.ulysses(q, k, v)
    q, k, v = (t.detach().to(DEV) for t in _qkv(0, shape=(2, 12, 4, 4)))
    with pytest.raises(ValueError, match=r"sequence length 12 and k/v's 12 .* by 2 \* cp=8"):
        cp_ops.ring_attention(q, k, v, causal=True)
    cp_ops.ring_attention(q, k, v, causal=False)  # 12 % 4 == 0: fine without zig-zag
    with pytest.raises(ValueError, match=r"initialize_context_parallel: cp_size=3 .* 4 devices"):
        cp_ops.initialize_context_parallel(3)
    with pytest.raises(ValueError, match="process_group must be"):
        cp_ops.ulysses(q, k, v, process_group=object())
    with pytest.raises(ValueError, match=r"q_lens must be an integer tensor of shape \(2,\)"):
        cp_ops.ring_attention(q, k, v, q_lens=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"k_lens \[3, 13\] must lie in \[0, 12\]"):
        cp_ops.ring_attention(q, k, v, k_lens=torch.tensor([3, 13]))
    with pytest.raises(ValueError, match=r"ulysses: dropout_p=1.0 must be in \[0, 1\)"):
        cp_ops.ulysses(q, k, v, dropout_p=1.0)


# ---------------------------------------------------------------------------------------------
# per-head masks and attention dropout in the region (Notes [Context parallel masks] and
# [Context parallel dropout] in torchacc/context_parallel/__init__.py)


class _SDPA(torch.nn.Module):
    def forward(self, q, k, v, mask=None, p=0.0, causal=False):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal
        )


def _sdpa_on_cp(algorithm, cp):
    """SDPA as dist.sp routes it: the region over a dp x cp mesh of the 4 devices."""
    from torchacc.context_parallel import model as cp_model
    from torchacc.sharding import api

    api.use_spmd()
    mesh = api.jax_mesh(range(4), (4 // cp, cp), ("dp", "cp"))
    api.adopt_mesh(mesh)
    model = _SDPA()
    cp_model.parallelize(model, mesh, "cp", ("dp",), algorithm=algorithm)
    return model


@pytest.mark.parametrize("algorithm,cp,kind", [("ulysses", 2, "bool"), ("ring", 4, "bias")])
def test_per_head_masks_match_eager(algorithm, cp, kind):
    """Under Ulysses a per-head bool mask [B, H, S, S], around the ring a per-head additive bias
    (ALiBi-like) given 3-D, [H, S, S] (SDPA broadcasts it over the batch): the region's output
    and dq/dk/dv equal eager SDPA's within 1e-5."""
    model = _sdpa_on_cp(algorithm, cp)
    B, H, S, D = 2, 4, 16, 8
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        mask = torch.rand(B, H, S, S, generator=g) > 0.4
        mask |= torch.eye(S, dtype=torch.bool)  # every query sees a key
    else:
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None]
        mask = -slopes * (torch.arange(S)[None, :] - torch.arange(S)[:, None]).abs().float()
    q, k, v = (torch.randn(B, H, S, D, generator=g, requires_grad=True) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn(want.shape, generator=g)
    want.backward(grad)
    qd, kd, vd = (t.detach().to(DEV).requires_grad_() for t in (q, k, v))
    out = model(qd, kd, vd, mask.to(DEV))
    out.backward(grad.to(DEV))
    torchacc.sync()
    for got, ref in ((out, want), (qd.grad, q.grad), (kd.grad, k.grad), (vd.grad, v.grad)):
        torch.testing.assert_close(got.cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 3, 16, 16\) must be"):
        model(qd, kd, vd, torch.ones(B, 3, S, S, dtype=torch.bool).to(DEV))


_DROPOUT_LAYOUTS = {  # mesh shape, names, a2a axes, ring axes, head axis, causal, kv heads, mask
    "ulysses, heads on tp, a per-head mask": (
        (1, 2, 2), ("dp", "tp", "cp"), ("cp",), (), "tp", False, 4, True,
    ),
    "causal zig-zag ring, GQA, batch on dp": (
        (2, 2), ("dp", "cp"), (), ("cp",), None, True, 2, False,
    ),
    "causal 2-D (Ulysses intra, ring inter), GQA": (
        (1, 2, 2), ("dp", "inter", "intra"), ("intra",), ("inter",), None, True, 2, False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(_DROPOUT_LAYOUTS))
def test_dropout_mask_is_the_unsharded_rules_for_the_seed(layout):
    """For one seed the region equals the unsharded attention rule of
    torchacc/lowering/fused_attention.py with that seed within 1e-5, forward and the VJP,
    whatever the layout: the keep mask is a function of the global index (b, h, i, j) only."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from torchacc.context_parallel.regions import _make_attention
    from torchacc.lowering import fused_attention

    shape, names, a2a, ring, hax, causal, kv, masked = _DROPOUT_LAYOUTS[layout]
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), names)
    B, S, H, D, p = 2, 16, 4, 8, 0.3
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, S, H, D), jnp.float32)
    k, v = (jax.random.normal(x, (B, S, kv, D), jnp.float32) for x in keys[1:3])
    g = jax.random.normal(keys[3], (B, S, H, D), jnp.float32)
    mask = None
    if masked:  # [B, H, S, S], every query seeing a key
        mask = (jax.random.uniform(keys[4], (B, H, S, S)) > 0.3) | jnp.eye(S, dtype=bool)
    seed = jnp.asarray(123456789, jnp.int64)
    scale = 1.0 / D**0.5
    bax = "dp" if shape[0] > 1 else None
    fwd = _make_attention(mesh, bax, a2a, ring, scale, causal, False, hax, ("mask",) * masked, p)
    extra = () if mask is None else (mask,)

    def region(q, k, v):
        return fwd(q, k, v, *extra, seed)

    def unsharded(q, k, v, rate=p):  # the rule's layout is [B, H, L, D]
        t = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        out, _ = fused_attention._xla_forward(*t, mask, causal, scale, seed, rate)
        return jnp.swapaxes(out, 1, 2)

    got, vjp = jax.vjp(jax.jit(region), q, k, v)
    want, vjp_ref = jax.vjp(jax.jit(unsharded), q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(vjp(g), vjp_ref(g)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(got - unsharded(q, k, v, 0.0)).max()) > 0.1  # something dropped


@pytest.mark.parametrize("algorithm,cp", [("ring", 4)])
def test_dropout_same_seed_same_step_and_the_keep_rate(algorithm, cp):
    """Through SDPA under dist.sp: q = k = 0 makes every probability 1/S and v = I reads the
    scaled keep mask off the output; the same torch.manual_seed gives the same mask, another
    seed another, about 1 - p of the entries kept, and dv is the kept probabilities' transpose
    times the output gradient (the backward drops what the forward dropped)."""
    model = _sdpa_on_cp(algorithm, cp)
    B, H, S, p = 2, 4, 16, 0.25
    q = k = torch.zeros(B, H, S, S).to(DEV)
    eye = torch.eye(S).expand(B, H, S, S).contiguous()
    grad = torch.randn(B, H, S, S, generator=torch.Generator().manual_seed(0))

    def draw(seed):
        torch.manual_seed(seed)
        v = eye.to(DEV).requires_grad_()
        out = model(q, k, v, None, p)
        out.backward(grad.to(DEV))
        torchacc.sync()
        return out.detach().cpu(), v.grad.cpu()

    (a, dva), (b, _), (c, _) = draw(7), draw(7), draw(8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = a * (1 - p) * S  # exactly 0 or 1
    assert torch.equal(kept, kept.round()) and set(kept.unique().tolist()) <= {0.0, 1.0}
    assert abs(kept.mean().item() - (1 - p)) < 0.05, kept.mean().item()
    probs = kept / ((1 - p) * S)
    torch.testing.assert_close(dva, probs.transpose(-1, -2) @ grad, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# ta.accelerate's dist.sp: context parallel for a whole model (torchacc/context_parallel/model.py)

VOCAB, B, T = 512, 4, 32


def _lm_pair(kind):
    from gallery.gpt.model import build_gpt
    from gallery.llama.model import build_llama

    build = {
        "llama": lambda: build_llama("llama-tiny"),
        "llama-kernels": lambda: build_llama("llama-tiny", kernels=True),
        # GPT-2-small's shape (blocks of fused head-major c_attn, GELU MLP, tied head), tiny
        "gpt": lambda: build_gpt("gpt-tiny", n_head=4),
    }[kind]
    torch.manual_seed(0)
    ref, model = build(), build()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _lm_train(model, batches, device=None, position_ids=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in batches:
        extra = () if position_ids is None else (position_ids,)
        if device is not None:
            ids, extra = ids.to(device), tuple(t.to(device) for t in extra)
        logits = model(ids[:, :-1], *extra)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device is not None:
            torchacc.sync()
        losses.append(loss.item())
    return losses


def _step_collectives():
    from torchacc.program import cache

    text = next(reversed(cache._cache.values())).as_text()
    return {op for op in ("all-to-all", "collective-permute") if op in text}


@pytest.mark.parametrize(
    "kind,fsdp,tp,sp,packed,algorithm",
    [
        ("llama", 1, 1, 4, False, "collective-permute"),  # kv heads 2 % 4: the causal ring
        ("llama-kernels", 1, 1, 2, True, "all-to-all"),  # dp x sp, packed rows as segment ids
        ("gpt", 2, 1, 2, False, "all-to-all"),  # fsdp x tp x pp x cp = 2 x 1 x 1 x 2
        ("llama", 1, 2, 2, True, "collective-permute"),  # tp x sp, packed rows' mask row-split
    ],
)
def test_dist_sp_in_accelerate_trains_like_eager(kind, fsdp, tp, sp, packed, algorithm):
    """Config.dist.sp (with fsdp / tp on the one mesh): two SGD steps of a gallery LM give
    eager's losses and parameters within 1e-5; the step program runs attention as the
    context-parallel region (ring: collective-permutes; Ulysses: all-to-alls)."""
    import torchacc as ta
    from torchacc.program import cache

    ref, model = _lm_pair(kind)
    config = ta.Config()
    config.dist.fsdp.size, config.dist.tp.size, config.dist.sp.size = fsdp, tp, sp
    model = ta.accelerate(model, config=config)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (B, T + 1), generator=g) for _ in range(2)]
    pos = None
    if packed:  # three sequences per row, position ids restarting at each
        pos = torch.cat([torch.arange(10), torch.arange(14), torch.arange(8)])[None].repeat(B, 1)
    cache.clear_memory_cache()
    losses = _lm_train(model, batches, model.device, pos)
    found = _step_collectives()  # (a cumsum of packed position ids on a split sequence also
    assert algorithm in found  # exchanges halos by collective-permute)
    assert algorithm == "all-to-all" or "all-to-all" not in found
    ref_losses = _lm_train(ref, batches, None, pos)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.detach().cpu() - q.detach()).abs().max().item() <= 1e-5, name


def test_dist_sp_bad_input(monkeypatch):
    import torchacc as ta

    config = ta.Config()
    config.dist.sp.size = 4
    config.dist.sp.algorithm = "zigzag"
    with pytest.raises(ValueError, match="dist.sp.algorithm must be 'auto', 'ulysses' or 'ring'"):
        ta.accelerate(torch.nn.Linear(2, 2), config=config)
    config.dist.sp.algorithm = "auto"
    config.backend = "eager"
    with monkeypatch.context() as m:
        m.setenv("WORLD_SIZE", "4")
        with pytest.raises(
            NotImplementedError, match="dist.sp.size = 4: sequence .* on backend 'eager'"
        ):
            ta.accelerate(torch.nn.Linear(2, 2), config=config)
    config.backend = "lazy"
    _, model = _lm_pair("llama")
    model = ta.accelerate(model, config=config)
    with pytest.raises(ValueError, match=r"sequence length 12 .* by 2 \* cp=8"):
        model(torch.zeros(4, 12, dtype=torch.long).to(model.device))
