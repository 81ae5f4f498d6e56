"""Worker of tests/test_context_parallel.py's torchrun case: TorchAcc's per-process style of
context parallel, 2 processes x 1 CPU device, each holding its chunk of the sequence.

    python -m torch.distributed.run --nproc_per_node=2 mp_context_parallel_worker.py OUT

Ulysses, ring and 2-D (causal, not, varlen) and split/gather: each rank's output chunk and its
gradients' chunks against full eager attention on CPU; writes OUT.<rank>.json with the errors.
"""

import json
import math
import sys

import torch
import torch.distributed as dist
from torchacc.ops import context_parallel as cp

import torchacc
import torchacc.torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")

DEV = torchacc.device()


def eager_attention(q, k, v, causal, lens=None):
    """With ``lens`` (one per row, for q and k): keys past it masked, queries past it give 0."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if lens is not None:
        pad = torch.arange(q.shape[1])[None, :] >= torch.tensor(lens)[:, None]
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    if lens is not None:
        out = out.masked_fill(pad[:, :, None, None], 0.0)
    return out


def main(out):
    dist.init_process_group(backend="xla", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = cp.initialize_context_parallel(world)
    assert cp.get_context_parallel_group() is group and group.size == world
    if world == 4:
        cp.initialize_context_parallel(4, 2)
        assert cp.get_intra_cp_process_group().groups == [[0, 1], [2, 3]]
        assert cp.get_inter_cp_process_group().groups == [[0, 2], [1, 3]]
    result = {}
    cases = [
        (op, causal, lens)
        for causal, lens in ((False, None), (True, None), (True, [3, 8]))
        for op in (cp.ulysses, cp.ring_attention, cp.context_parallel_2d)
    ]
    for op, causal, lens in cases:
        if op is cp.context_parallel_2d:  # intra groups of 2 (x 2 inter with 4 processes)
            cp.initialize_context_parallel(world, 2)
        else:
            cp.initialize_context_parallel(world)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 8, 4, 4, generator=g, requires_grad=True) for _ in range(3))
        want = eager_attention(q, k, v, causal, lens)
        grad_out = torch.randn(want.shape, generator=g)
        want.backward(grad_out)
        # this rank's chunk of the sequence, as TorchAcc's scripts hold it
        full = [t.detach().to(DEV).requires_grad_() for t in (q, k, v)]
        local = [cp.split_forward_gather_backward(t, 1) for t in full]
        dev_lens = None if lens is None else torch.tensor(lens).to(DEV)
        o = op(*local, q_lens=dev_lens, k_lens=dev_lens, causal=causal)
        gathered = cp.gather_forward_split_backward(o, 1)
        gathered.backward(grad_out.to(DEV))
        torchacc.sync()
        errs = [(o.cpu() - want.detach().chunk(world, 1)[rank]).abs().max().item()]
        errs.append((gathered.cpu() - want.detach()).abs().max().item())
        errs += [(t.grad.cpu() - r.grad).abs().max().item() for t, r in zip(full, (q, k, v))]
        case = "varlen" if lens else "causal" if causal else "full"
        result[f"{op.__name__}-{case}"] = errs
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
