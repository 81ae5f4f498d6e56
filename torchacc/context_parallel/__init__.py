"""``torchacc.ops.context_parallel``: TorchAcc's context parallel (Ulysses, ring attention, the
split/gather helpers) as manual regions over the ``cp`` axis of the one mesh.

SPMD style: the tensors are global (``[batch, seq, heads, head_dim]``); each op is one
``jax.shard_map`` over the mesh ``initialize_context_parallel`` makes (axes ``dp`` x ``inter``
x ``intra``; the context-parallel group is ``inter x intra``), the sequence dimension split
over the group's axes and the batch on ``dp``, with JAX's collectives inside
(Note [Context parallel]). Each op is one node of the step forward and one backward (the
backward is JAX's VJP of the same region, recomputing the forward). Nothing of torchacc's own
moves data: ``all_to_all`` / ``ppermute`` are JAX's, the layouts around the region XLA's.

Per-process style (TorchAcc's: torchrun, one device per process, SPMD mode off): each process
holds its chunk of the sequence and the ops are torch ops over the engine's collectives
(per_process.py), the same algorithms on rank groups instead of mesh axes.

Note [Context parallel]
    Ulysses: each device holds ``seq / cp`` tokens of every head; an ``all_to_all`` over ``cp``
    trades them for every token of ``heads / cp`` heads, attention runs locally, and a second
    ``all_to_all`` trades back. Needs heads (of q and of k/v) divisible by cp.
    Ring: each device keeps its queries and passes its K/V block to the next device of the ring
    (``ppermute``) cp - 1 times, merging each block's scores by online softmax (running max,
    running sum). Causal ring uses the zig-zag split: the sequence cut into 2 * cp chunks,
    device i holds chunks i and 2 * cp - 1 - i, so every device has the same amount of unmasked
    work; the reorder into and out of that layout is two ``ppermute`` s inside the region
    (chunk c of device c // 2 goes to device c or 2 * cp - 1 - c), so no device ever holds
    more than its share of q, k, v (an XLA gather around the region would gather them). Masks are
    computed from the tokens' global positions, which travel with the K/V block. Needs seq
    divisible by cp (2 * cp when causal).
    Varlen: ``q_lens`` / ``k_lens`` ([batch] integers) say how many tokens of each row are
    real (padding at the end): keys at or past k_len are masked, queries at or past q_len give
    0. The lengths enter the region as arrays split on ``dp``; the masks use global positions.
    2-D: Ulysses inside each ``intra`` group, then the ring across them (``inter``), in one
    region; the positions are all-gathered over ``intra`` in the all-to-all's order, so the
    ring's masks stay right.

Note [Context parallel masks]
    Besides causal and varlen, the region takes two masks (what a model's attention call
    carries; torchacc/context_parallel/model.py passes them on):
    - segment ids of packed rows ([batch, seq] integers, a token attends only to its own
      segment): split on the sequence like q, gathered with the positions under Ulysses, and
      k's travel around the ring with its block. O(seq / cp) per device.
    - a general mask (bool, True = attend, or additive) [batch or 1, heads or 1, q seq, k seq]:
      its rows are split with q's tokens and each ring step picks the columns of its block's
      keys by their global positions. Under Ulysses a mask of one head is gathered over the
      all-to-all axes (every row), a per-head mask (ALiBi-style biases, per-head patterns) is
      traded like q (an all-to-all: every row of this device's heads); under tensor parallel a
      per-head mask's heads lie on the head axis with q's. O(seq^2 / cp) per device for the
      ring and for per-head masks, O(seq^2 / intra) for a one-head mask under Ulysses: segment
      ids are the way for long packed rows.
    A query whose keys are all masked gives 0 (SDPA gives NaN for a bool mask, the mean of v
    for an additive one of equal values).

Note [Context parallel dropout]
    ``dropout_p > 0`` (the ops' argument, SDPA's / flash_attention's under ``dist.sp``) drops
    attention probabilities after the softmax, the kept ones scaled by 1 / (1 - p), as SDPA
    does; the softmax's sum is taken before dropout. The randomness is one seed per call, drawn
    from the step's RNG by a random node of its own (``call_jax_rng``: 32 bits of the node's key
    as int64, the unsharded attention rule's formula in torchacc/lowering/fused_attention.py);
    the forward and the backward (JAX's VJP, recomputing the forward) read the same seed. What
    holds:
    - the keep mask is a function of the seed and the *global* index (b, h, i, j) of the
      [B, H, Sq, Sk] scores alone: ``jax.random.uniform(jax.random.key(seed), (B, H, Sq, Sk))
      >= p``, exactly the mask the unsharded rule draws from that seed. Each device computes
      only its blocks' bits (partitionable threefry: an element's bits come from its flat
      index; with ``jax_threefry_partitionable`` off the whole draw is made and indexed). So for
      one seed the result is the same for Ulysses, ring, 2-D, any cp, the zig-zag layout, tp
      and the batch split, and equals the unsharded attention with that seed's mask;
    - ``torch.manual_seed`` makes a step reproducible, as for any dropout of the step;
    - not bit-equal to a run without context parallel: the seed comes from this call's own
      node, so it differs from the one the unsharded program's attention node draws, and not to
      eager PyTorch's CPU/CUDA generator (no torchacc dropout is). The statistics are the same.
    The per-process style (one sequence chunk per process) refuses dropout with a ValueError.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torchacc.context_parallel.per_process import (
    ProcessGroups,
    _2d_per_process,
    _Gather,
    _ring_per_process,
    _Split,
    _ulysses_per_process,
)
from torchacc.context_parallel.regions import (
    _cached,
    _fns,  # noqa: F401  (the tests read the cached regions)
    _jax_node,
    _make_attention,
    _with_vjp,
)
from torchacc.lowering.dtypes import jdtype as _jdtype
from torchacc.sharding import api

__all__ = [
    "initialize_context_parallel",
    "get_context_parallel_group",
    "ulysses",
    "ring_attention",
    "split_forward_gather_backward",
    "gather_forward_split_backward",
    "context_parallel_2d",
    "get_inter_cp_process_group",
    "get_intra_cp_process_group",
]


class ContextParallelGroup:
    """Mesh axes of the ``dp x inter x intra`` mesh of :func:`initialize_context_parallel`: the
    whole context-parallel group (``inter`` and ``intra``), or one of them. What
    ``get_context_parallel_group()`` & co. return and ``process_group=`` takes. On a model's
    mesh (``ta.accelerate``'s ``dist.sp``, torchacc/context_parallel/model.py) the batch lies
    on ``batch_axes`` and the heads on ``head_axis`` (tensor parallel) around the region."""

    def __init__(self, mesh, axes, batch_axes=("dp",), head_axis=None):
        self.mesh, self.axes = mesh, tuple(axes)
        self.size = int(np.prod([mesh.shape[a] for a in self.axes]))
        self.batch_axes = tuple(a for a in batch_axes if a in mesh.shape)
        self.head_axis = head_axis

    @property
    def spec(self):
        """The partition-spec entry splitting a dimension over the group."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def __repr__(self):
        axes = " x ".join(self.axes)
        return f"ContextParallelGroup({axes}={self.size}, mesh={dict(self.mesh.shape)})"


_groups: dict = {}  # "cp" / "inter" / "intra" -> ContextParallelGroup (or ProcessGroups)


def initialize_context_parallel(cp_size, intra_size=None):
    """Lay the job's devices out as a ``dp x inter x intra`` mesh (``inter * intra = cp_size``;
    ``intra`` defaults to ``cp_size``; consecutive devices form one ``intra`` group, as
    TorchAcc's ranks do) and switch SPMD mode on. Returns the context-parallel group. In a
    torchrun job of one device per process with SPMD mode off, the same layout is made of
    rank groups instead (the per-process style)."""
    cp_size = int(cp_size)
    n = api.device_count()
    if cp_size < 1 or n % cp_size:
        raise ValueError(
            f"initialize_context_parallel: cp_size={cp_size} must divide the job's {n} devices"
        )
    intra = cp_size if intra_size is None else int(intra_size)
    if intra < 1 or cp_size % intra:
        raise ValueError(
            f"initialize_context_parallel: intra_size={intra_size} must divide cp_size={cp_size}"
        )
    from torchacc.runtime import processes

    world = processes.world_size()
    if world > 1 and not api.is_spmd() and api.local_device_count() == 1:
        # TorchAcc's way: one process per device, each holding its chunk of the sequence;
        # ranks laid out as dp x inter x intra, as TorchAcc's groups are
        grid = np.arange(world).reshape(world // cp_size, cp_size // intra, intra)
        rank = processes.rank()
        _groups.clear()
        _groups.update(
            cp=ProcessGroups(grid.reshape(-1, cp_size).tolist(), rank),
            inter=ProcessGroups(
                grid.transpose(0, 2, 1).reshape(-1, cp_size // intra).tolist(), rank
            ),
            intra=ProcessGroups(grid.reshape(-1, intra).tolist(), rank),
        )
        return _groups["cp"]
    if not api.is_spmd():
        api.use_spmd()
    shape = (n // cp_size, cp_size // intra, intra)
    mesh = api.jax_mesh(range(n), shape, ("dp", "inter", "intra"))
    api.adopt_mesh(mesh)  # the step's results are laid out on it (dp x cp shardings)
    _groups.update(
        cp=ContextParallelGroup(mesh, ("inter", "intra")),
        inter=ContextParallelGroup(mesh, ("inter",)),
        intra=ContextParallelGroup(mesh, ("intra",)),
    )
    return _groups["cp"]


def _initialized(name, call):
    if name not in _groups:
        raise RuntimeError(f"{call}: call initialize_context_parallel(cp_size) first")
    return _groups[name]


def get_context_parallel_group():
    """The whole context-parallel group (``inter x intra``)."""
    return _initialized("cp", "get_context_parallel_group")


def get_inter_cp_process_group():
    """The ring part of 2-D context parallel (across ``intra`` groups)."""
    return _initialized("inter", "get_inter_cp_process_group")


def get_intra_cp_process_group():
    """The Ulysses part of 2-D context parallel (consecutive devices)."""
    return _initialized("intra", "get_intra_cp_process_group")


def _resolve(process_group, call, default="cp"):
    if process_group is None:
        return _initialized(default, call)
    if isinstance(process_group, (ContextParallelGroup, ProcessGroups)):
        return process_group
    raise ValueError(
        f"{call}: process_group must be a group of get_context_parallel_group() & co. (or None), "
        f"got {process_group!r}; torch process groups (one sequence chunk per process) are not "
        "supported yet"
    )


# ---------------------------------------------------------------------------------------------
# checks


def _check_qkv(q, k, v, call, dropout_p, q_lens, k_lens, chunks=1):
    """Checks; the lengths as int32 device tensors ([] without varlen). ``chunks``: how many
    processes' chunks make a sequence (per-process style), for the lengths' bound."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{call}: {name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{call}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
            "(k and v equal; batch and head_dim as q's)"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{call}: q's {q.shape[2]} heads must be a multiple of k/v's {k.shape[2]} (GQA)"
        )
    _check_dropout(call, dropout_p)
    lens = []
    sizes = (q.shape[1] * chunks, k.shape[1] * chunks)
    for name, n, t in (("q_lens", sizes[0], q_lens), ("k_lens", sizes[1], k_lens)):
        if t is None:
            lens.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t)
        if tuple(t.shape) != (q.shape[0],) or t.is_floating_point():
            raise ValueError(
                f"{call}: {name} must be an integer tensor of shape ({q.shape[0]},) (one length "
                f"per batch row), got {t.dtype} of shape {tuple(t.shape)}"
            )
        if t.device.type == "cpu" and ((t < 0) | (t > n)).any():
            raise ValueError(f"{call}: {name} {t.tolist()} must lie in [0, {n}]")
        lens.append(t.to(q.device, torch.int32))
    if lens == [None, None]:
        return []
    full = [torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device) for n in sizes]
    return [full[i] if t is None else t for i, t in enumerate(lens)]


def _per_process_dropout(call, dropout_p):
    if dropout_p:
        raise ValueError(
            f"{call}: dropout_p={dropout_p} is not supported in the per-process style (one "
            "sequence chunk per process); the SPMD style (a cp mesh axis, dist.sp) supports it"
        )


def _check_dropout(call, dropout_p):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise ValueError(f"{call}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{call}: dropout_p={dropout_p} must be in [0, 1)")


def _attention(
    call,
    q,
    k,
    v,
    lens,
    a2a_group,
    ring_group,
    softmax_scale,
    causal,
    segments=(),
    mask=None,
    dropout_p=0.0,
):
    """Checks, then the region: Ulysses over ``a2a_group``, the ring over ``ring_group``.
    ``segments``: (q's, k's) segment ids [batch, seq] of packed rows; ``mask``: a bool or additive
    mask [batch or 1, heads or 1, q seq, k seq] (Note [Context parallel masks]); ``dropout_p``:
    attention dropout drawn from the step's RNG (Note [Context parallel dropout])."""
    _check_dropout(call, dropout_p)
    a2a = a2a_group.axes if a2a_group is not None and a2a_group.size > 1 else ()
    ring = ring_group.axes if ring_group is not None and ring_group.size > 1 else ()
    group = a2a_group or ring_group
    mesh = group.mesh
    n_a2a = a2a_group.size if a2a else 1
    n_ring = ring_group.size if ring else 1
    cp = n_a2a * n_ring
    hax = group.head_axis
    tp = int(mesh.shape[hax]) if hax is not None else 1
    if tp > 1 and (q.shape[2] % tp or k.shape[2] % tp):
        raise ValueError(
            f"{call}: q's {q.shape[2]} heads and k/v's {k.shape[2]} heads must be divisible by "
            f"the tensor-parallel size {tp} (axis {hax!r})"
        )
    if a2a and (q.shape[2] // tp % n_a2a or k.shape[2] // tp % n_a2a):
        raise ValueError(
            f"{call}: q's {q.shape[2]} heads and k/v's {k.shape[2]} heads"
            + (f" (per tensor-parallel device: / {tp})" if tp > 1 else "")
            + f" must be divisible by {'the intra group size' if ring else 'cp'}={n_a2a}"
        )
    zigzag = causal and n_ring > 1
    chunks = 2 * cp if zigzag else cp
    if q.shape[1] % chunks or k.shape[1] % chunks:
        raise ValueError(
            f"{call}: q's sequence length {q.shape[1]} and k/v's {k.shape[1]} must be divisible "
            f"by {'2 * cp' if zigzag else 'cp'}={chunks} (cp={cp}"
            + (", zig-zag split for causal balance)" if zigzag else ")")
        )
    if (causal or segments or mask is not None) and q.shape[1] != k.shape[1] and mask is None:
        raise ValueError(
            f"{call}: causal or packed attention needs q and k/v of one sequence length, got "
            f"{q.shape[1]} and {k.shape[1]}"
        )
    if mask is not None and (
        mask.dim() != 4
        or mask.shape[0] not in (1, q.shape[0])
        or mask.shape[1] not in (1, q.shape[2])
        or tuple(mask.shape[2:]) != (q.shape[1], k.shape[1])
    ):
        raise ValueError(
            f"{call}: attn_mask of shape {tuple(mask.shape)} must be [batch or 1, heads "
            f"({q.shape[2]}) or 1, {q.shape[1]}, {k.shape[1]}] under context parallel"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    baxes = group.batch_axes
    nb = int(np.prod([mesh.shape[a] for a in baxes])) if baxes else 1
    bax = None
    if nb > 1 and q.shape[0] % nb == 0:
        bax = baxes[0] if len(baxes) == 1 else baxes
    extras = (("lens",) if lens else ()) + (("segments",) if segments else ())
    extras += ("mask",) if mask is not None else ()
    rate = float(dropout_p)
    key = ("attention", id(mesh), bax, a2a, ring, scale, bool(causal), extras, hax, rate)
    fwd = _cached(
        key,
        lambda: _make_attention(
            mesh, bax, a2a, ring, scale, bool(causal), False, hax, extras, rate
        ),
    )
    inputs = (q, k, v, *lens, *segments, *([] if mask is None else [mask]))
    if rate:  # the seed: one random node of the step (Note [Context parallel dropout])
        inputs = (*inputs, _dropout_seed(q))
    return _with_vjp(fwd, inputs, call, n_diff=3)


def _draw_seed(q, rng):
    """The unsharded attention rule's seed (torchacc/lowering/fused_attention.py): 32 random
    bits of the node's key, as int64."""
    del q
    return (jax.random.bits(rng, (), jax.numpy.uint32).astype(jax.numpy.int64),)


def _dropout_seed(q):
    """A 0-d int64 tensor drawn from the step's RNG (a ``call_jax_rng`` node; ``q`` only
    places it): the region's forward and its backward read the same one."""
    from torchacc.lowering import region as _region

    spec = jax.ShapeDtypeStruct(tuple(q.shape), _jdtype(q.dtype))
    _, treedef = jax.tree_util.tree_flatten(((spec,), {}))
    _, out_tree = jax.tree_util.tree_flatten((0,))
    call = _seed_calls.get(treedef)
    if call is None:
        precision = jax.config.jax_default_matmul_precision
        meta = [((), torch.int64)]
        call = _region.JaxCall(_draw_seed, treedef, range(1), {}, precision, meta, out_tree)
        _seed_calls[treedef] = call
    return _region.call_jax_rng([q.detach()], call.key)[0]


_seed_calls: dict = {}


def ulysses(
    q,
    k,
    v,
    q_lens=None,
    k_lens=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    process_group=None,
):
    """Attention of ``q, k, v`` ([batch, seq, heads, head_dim]) with the sequence split over the
    group (default: the whole context-parallel group), by all-to-all over heads (Note [Context
    parallel]). Returns q's shape."""
    group = _resolve(process_group, "ulysses")
    per = group.size if isinstance(group, ProcessGroups) else 1
    lens = _check_qkv(q, k, v, "ulysses", dropout_p, q_lens, k_lens, per)
    if isinstance(group, ProcessGroups):
        _per_process_dropout("ulysses", dropout_p)
        return _ulysses_per_process(q, k, v, lens, group, softmax_scale, causal)
    return _attention(
        "ulysses", q, k, v, lens, group, None, softmax_scale, causal, dropout_p=dropout_p
    )


def ring_attention(
    q,
    k,
    v,
    q_lens=None,
    k_lens=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    process_group=None,
):
    """Attention of ``q, k, v`` ([batch, seq, heads, head_dim]) with the sequence split over the
    group (default: the whole context-parallel group): K/V blocks go around the ring
    (``ppermute``), merged by online softmax; causal attention uses the zig-zag split (Note
    [Context parallel]). Returns q's shape."""
    group = _resolve(process_group, "ring_attention")
    per = group.size if isinstance(group, ProcessGroups) else 1
    lens = _check_qkv(q, k, v, "ring_attention", dropout_p, q_lens, k_lens, per)
    if isinstance(group, ProcessGroups):
        _per_process_dropout("ring_attention", dropout_p)
        return _ring_per_process(q, k, v, lens, group, softmax_scale, causal)
    return _attention(
        "ring_attention", q, k, v, lens, None, group, softmax_scale, causal, dropout_p=dropout_p
    )


def context_parallel_2d(
    q,
    k,
    v,
    q_lens=None,
    k_lens=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    inter_process_group=None,
    intra_process_group=None,
):
    """2-D context parallel: Ulysses (all-to-all over heads) inside each ``intra`` group, ring
    attention across them (``inter``), one region. The groups default to those of
    :func:`initialize_context_parallel` (``intra_size``). Returns q's shape."""
    call = "context_parallel_2d"
    inter = _resolve(inter_process_group, call, "inter")
    intra = _resolve(intra_process_group, call, "intra")
    if isinstance(inter, ProcessGroups) != isinstance(intra, ProcessGroups):
        raise ValueError(f"{call}: the inter and intra groups are of different styles")
    if isinstance(inter, ProcessGroups):
        lens = _check_qkv(q, k, v, call, dropout_p, q_lens, k_lens, inter.size * intra.size)
        _per_process_dropout(call, dropout_p)
        return _2d_per_process(q, k, v, lens, inter, intra, softmax_scale, causal)
    if inter.mesh is not intra.mesh:
        raise ValueError(f"{call}: the inter and intra groups come from different meshes")
    lens = _check_qkv(q, k, v, call, dropout_p, q_lens, k_lens)
    return _attention(call, q, k, v, lens, intra, inter, softmax_scale, causal, dropout_p=dropout_p)


# ---------------------------------------------------------------------------------------------
# split / gather


def _check_dim(x, dim, group, call):
    if x.dim() == 0:
        raise ValueError(f"{call}: expects a tensor of rank >= 1, got a 0-d tensor")
    d = dim % x.dim() if -x.dim() <= dim < x.dim() else None
    if d is None:
        raise ValueError(f"{call}: dim={dim} out of range for a tensor of shape {tuple(x.shape)}")
    if x.shape[d] % group.size:
        raise ValueError(
            f"{call}: dimension {d} of size {x.shape[d]} (shape {tuple(x.shape)}) is not "
            f"divisible by cp={group.size}"
        )
    return d


def _layout_op(x, d, group, split_forward, name):
    ndim = x.dim()
    split = NamedSharding(group.mesh, P(*[(group.spec if i == d else None) for i in range(ndim)]))
    whole = NamedSharding(group.mesh, P())
    first, second = (split, whole) if split_forward else (whole, split)

    def make():
        def fwd(x):
            return jax.lax.with_sharding_constraint(x, first)

        return fwd

    fwd = _cached((name, id(group.mesh), group.axes, d, ndim), make)

    def make_bwd():
        def bwd(g):
            return jax.lax.with_sharding_constraint(g, second)

        return bwd

    bwd = _cached((name + "_bwd", id(group.mesh), group.axes, d, ndim), make_bwd)

    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return _jax_node(fwd, (t,), name)[0]

        @staticmethod
        def backward(ctx, g):
            return _jax_node(bwd, (g.contiguous(),), name + "_bwd")[0]

    return _Op.apply(x)


def split_forward_gather_backward(x, dim, process_group=None):
    """SPMD style: ``x`` (global) laid out split along ``dim`` on the ``cp`` axis, each device
    holding its chunk; its gradient is gathered (replicated) in the backward. Values unchanged:
    in SPMD style a "split" is a layout, the tensor keeps its global shape."""
    call = "split_forward_gather_backward"
    group = _resolve(process_group, call)
    if isinstance(group, ProcessGroups):
        return _Split.apply(x, _check_dim(x, dim, group, call), group)
    d = _check_dim(x, dim, group, call)
    return _layout_op(x, d, group, True, "cp_split")


def gather_forward_split_backward(x, dim, process_group=None):
    """SPMD style: ``x`` gathered (replicated over ``cp``) forward; its gradient laid out split
    along ``dim`` on ``cp`` in the backward. Values unchanged."""
    call = "gather_forward_split_backward"
    group = _resolve(process_group, call)
    if isinstance(group, ProcessGroups):
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            raise ValueError(
                f"{call}: dim={dim} out of range for a tensor of shape {tuple(x.shape)}"
            )
        return _Gather.apply(x, dim % x.dim(), group)
    d = _check_dim(x, dim, group, call)
    return _layout_op(x, d, group, False, "cp_gather")
