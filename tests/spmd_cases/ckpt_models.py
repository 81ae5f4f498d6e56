"""Models and helpers shared by the distributed-checkpoint cases (no side effects on import)."""

import numpy as np
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

import torchacc
import torchacc.torch_xla.distributed.spmd as xs
from torchacc.distributed import sharding as engine
from torchacc.lazy.record import value_of
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def tensor_parallel(model, mesh, dim0="model"):
    """Model-parallel weights: split on the mesh's model axis, replicated on the others."""
    xs.mark_sharding(model[0].weight, mesh, (dim0, None) if dim0 else (None, "model"))
    xs.mark_sharding(model[0].bias, mesh, ("model",))
    xs.mark_sharding(model[2].weight, mesh, (None, "model"))
    return model


class Opts:
    """One AdamW per model (each model's step is its own program, on its own mesh)."""

    def __init__(self, *models):
        self.opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]


def build(dev, tp_mesh, fsdp_mesh, seed=0, tp_dim0="model"):
    """The two models of the checkpoint: a tensor-parallel MLP and an FSDPv2 MLP, with their
    AdamW optimizers."""
    tp = tensor_parallel(mlp(seed).to(dev), tp_mesh, tp_dim0)
    fsdp = FSDPv2(mlp(seed + 1).to(dev), fsdp_mesh)
    return tp, fsdp, Opts(tp, fsdp)


def step(tp, fsdp, opts, dev, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=gen)
    for model, opt in zip((tp, fsdp), opts.opts):
        model(x.to(dev)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()


def prime(opts, prime_optimizer):
    for opt in opts.opts:
        prime_optimizer(opt)


def state(tp, fsdp, opts):
    return {
        "tp": tp.state_dict(),
        "fsdp": fsdp.state_dict(),
        "opt_tp": opts.opts[0].state_dict(),
        "opt_fsdp": opts.opts[1].state_dict(),
    }


def host_copy(sd):
    """Flat CPU copies of every tensor of a state dict (``fqn -> tensor``)."""
    flat, _ = flatten_state_dict(sd)
    return {k: v.detach().cpu().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def assert_equal(sd, ref):
    flat, _ = flatten_state_dict(sd)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == sorted(ref)
    for k, v in tensors.items():
        assert torch.equal(v.detach().cpu(), ref[k]), k


def spec_of(t):
    """Which block of ``t``'s array each device holds: ``{device id: ((start, stop), ...)}``."""
    s = engine.sharding_of(t)
    if s is None:
        return None
    buf = value_of(t).buf
    shape = tuple(getattr(buf, "shape", t.shape))  # padded where the layout needs it
    return {
        d.id: tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
        for d, index in s.devices_indices_map(shape).items()
    }


def specs(sd):
    flat, _ = flatten_state_dict(sd)
    return {k: spec_of(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}


def mesh(ids, shape, names):
    return xs.Mesh(np.asarray(ids), shape, names)
