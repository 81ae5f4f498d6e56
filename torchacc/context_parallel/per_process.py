"""The per-process half of ``torchacc.ops.context_parallel`` (context_parallel/__init__.py):
TorchAcc's style under torchrun, one device per process, each holding its chunk of the sequence.
Torch ops and the engine's collectives (sharding/collectives.py), each collective with its
adjoint as the backward; the ring's causal zig-zag moves the chunks' halves with two permutes.
"""

from __future__ import annotations

import math

import torch

from torchacc.sharding import collectives


class ProcessGroups:
    """Per-process style (torchrun, one device per process, SPMD mode off): the context-parallel
    groups as lists of consecutive ranks; each process holds its own sequence chunk."""

    def __init__(self, groups, rank):
        self.groups = [list(g) for g in groups]
        self.size = len(self.groups[0])
        self.index = next(g.index(rank) for g in self.groups if rank in g)  # rank in its group

    def __repr__(self):
        return f"ProcessGroups(cp={self.size}, groups={self.groups})"


# ---------------------------------------------------------------------------------------------
# collectives with their adjoints as backward


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split, concat, group):
        ctx.dims, ctx.group = (split, concat), group
        return collectives.all_to_all(x, split, concat, group.size, group.groups)

    @staticmethod
    def backward(ctx, g):
        split, concat = ctx.dims
        out = collectives.all_to_all(
            g.contiguous(), concat, split, ctx.group.size, ctx.group.groups
        )
        return out, None, None, None


class _Split(torch.autograd.Function):
    """This process's chunk of ``dim``; the gradient all-gathered."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return x.chunk(group.size, dim)[group.index].contiguous()

    @staticmethod
    def backward(ctx, g):
        return collectives.all_gather(g.contiguous(), ctx.dim, ctx.group.groups), None, None


class _Gather(torch.autograd.Function):
    """Every process's chunk concatenated along ``dim``; the gradient split back (TorchAcc's
    semantics: the gradient is the same on every process)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return collectives.all_gather(x.contiguous(), dim, group.groups)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.group.size, ctx.dim)[ctx.group.index].contiguous(), None, None


def _ulysses_per_process(q, k, v, lens, group, softmax_scale, causal):
    """Each process holds [b, seq / cp, h, d]: all-to-all to [b, seq, h / cp, d], attention on
    whole sequences (torch ops), all-to-all back."""
    call = "ulysses"
    cp = group.size
    if q.shape[2] % cp or k.shape[2] % cp:
        raise ValueError(
            f"{call}: q's {q.shape[2]} heads and k/v's {k.shape[2]} heads must be divisible by "
            f"cp={cp}"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    q, k, v = (_AllToAll.apply(x, 2, 1, group) for x in (q, k, v))
    qpos = torch.arange(q.shape[1], device=q.device)
    kpos = torch.arange(k.shape[1], device=q.device)
    out = _online_attention(q, k, v, qpos, lambda step: kpos, 1, None, None, scale, causal, lens)
    return _AllToAll.apply(out, 1, 2, group)


class _Permute(torch.autograd.Function):
    """Member ``group[i]`` sends to ``group[dest(i)]`` (``dest``: a permutation of the member
    indices, the same in every group); the gradient goes back the other way."""

    @staticmethod
    def forward(ctx, x, group, dest):
        ctx.group, ctx.dest = group, dest
        return collectives.collective_permute(x, _pairs(group, dest))

    @staticmethod
    def backward(ctx, g):
        back = [0] * len(ctx.dest)
        for i, t in enumerate(ctx.dest):
            back[t] = i
        return collectives.collective_permute(g.contiguous(), _pairs(ctx.group, back)), None, None


def _pairs(group, dest):
    return [(g[i], g[dest[i]]) for g in group.groups for i in range(len(g))]


def _zigzag_dest(n, half):
    """Member index that gets chunk ``2 * r + half`` of member r in the zig-zag layout (member i
    holds chunks i and 2 * n - 1 - i of the 2 * n)."""
    return [j if j < n else 2 * n - 1 - j for j in (2 * r + half for r in range(n))]


def _ring_per_process(q, k, v, lens, group, softmax_scale, causal):
    """Each process holds its contiguous chunk (member i: tokens i * c .. (i + 1) * c). Causal:
    the chunks' halves move to the zig-zag layout first (two permutes) and back after, so every
    member has the same unmasked work. K/V go around the ring, merged by online softmax in torch
    ops; the masks come from the tokens' global positions."""
    n, r = group.size, group.index
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    sq, sk, dev = q.shape[1], k.shape[1], q.device
    ring = [(i + 1) % n for i in range(n)]
    if not causal or n == 1:
        qpos = torch.arange(sq, device=dev) + r * sq

        def kpos(step):  # the block of step ``step`` came from member (r - step) % n
            return torch.arange(sk, device=dev) + ((r - step) % n) * sk

        return _online_attention(q, k, v, qpos, kpos, n, group, ring, scale, causal, lens)
    if sq % 2 or sq != sk:
        raise ValueError(
            f"ring_attention: causal zig-zag needs each process's q and k/v chunks of one even "
            f"length, got {sq} and {sk} (cp={n})"
        )
    h = sq // 2
    dests = [_zigzag_dest(n, half) for half in (0, 1)]

    def to_zigzag(x):  # even members get (first half, second half), odd ones the reverse
        a, b = (_Permute.apply(p, group, d) for p, d in zip(x.split(h, 1), dests))
        return torch.cat([a, b] if r % 2 == 0 else [b, a], 1)

    def positions(member):
        return torch.cat(
            [torch.arange(h, device=dev) + c * h for c in (member, 2 * n - 1 - member)]
        )

    qz, kz, vz = to_zigzag(q), to_zigzag(k), to_zigzag(v)
    out = _online_attention(
        qz,
        kz,
        vz,
        positions(r),
        lambda step: positions((r - step) % n),
        n,
        group,
        ring,
        scale,
        causal,
        lens,
    )
    first, second = out.split(h, 1)
    a, b = (first, second) if r % 2 == 0 else (second, first)
    back = []
    for piece, d in zip((a, b), dests):
        inverse = [0] * n
        for i, t in enumerate(d):
            inverse[t] = i
        back.append(_Permute.apply(piece, group, inverse))
    return torch.cat(back, 1)


def _online_attention(q, k, v, qpos, kpos_of, n, group, ring, scale, causal, lens):
    """Attention of ``q`` over ``n`` K/V blocks (the next one from the ring's previous member),
    merged by online softmax; masks from the global positions and the lengths."""
    b, sq, h, d = q.shape
    dev = q.device
    qf = q.float()
    m = torch.full((b, h, sq), -1e30, device=dev)
    den = torch.zeros((b, h, sq), device=dev)
    acc = torch.zeros((b, h, sq, d), device=dev)
    for step in range(n):
        rep = h // k.shape[2]
        kx = k.repeat_interleave(rep, dim=2) if rep > 1 else k
        vx = v.repeat_interleave(rep, dim=2) if rep > 1 else v
        s = torch.einsum("bqhd,bkhd->bhqk", qf, kx.float()) * scale
        kpos = kpos_of(step)
        mask = (qpos[:, None] >= kpos[None, :])[None, None] if causal else None
        if lens:  # keys at or past a row's k_len are padding
            keep = (kpos[None, :] < lens[1][:, None])[:, None, None]
            mask = keep if mask is None else mask & keep
        if mask is not None:
            s = torch.where(mask, s, torch.full_like(s, -1e30))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        if mask is not None:
            p = torch.where(mask, p, torch.zeros_like(p))
        alpha = torch.exp(m - m_new)
        den = den * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bhqk,bkhd->bhqd", p, vx.float())
        m = m_new
        if step + 1 < n:
            k, v = _Permute.apply(k, group, ring), _Permute.apply(v, group, ring)
    out = acc / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    if lens:  # queries at or past q_len give 0
        out = torch.where((qpos[None, :] < lens[0][:, None])[:, None, :, None], out, 0.0)
    return out.transpose(1, 2).to(q.dtype)


def _2d_per_process(q, k, v, lens, inter, intra, softmax_scale, causal):
    """Ulysses inside the ``intra`` group (consecutive ranks: after the all-to-all each holds
    its group's contiguous segment for heads / intra heads), the ring across ``inter`` on those
    segments, the all-to-all back."""
    if q.shape[2] % intra.size or k.shape[2] % intra.size:
        raise ValueError(
            f"context_parallel_2d: q's {q.shape[2]} heads and k/v's {k.shape[2]} heads must be "
            f"divisible by the intra group size={intra.size}"
        )
    if intra.size > 1:
        q, k, v = (_AllToAll.apply(x, 2, 1, intra) for x in (q, k, v))
    out = _ring_per_process(q, k, v, lens, inter, softmax_scale, causal)
    return _AllToAll.apply(out, 1, 2, intra) if intra.size > 1 else out
