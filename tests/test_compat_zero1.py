"""torch_xla's ZeroRedundancyOptimizer (ZeRO-1) on torchacc: numerics against eager torch.optim.

One process (a world of 1: the slice is the whole parameter) in-process; two processes (padded
slices, reduce-scatter and all-gather recorded in the step) through tests/distributed_worker.py.
"""

import pytest
import torch
import torch.nn as nn
from distributed_launch import load, report, torchrun

import torchacc
from torchacc.torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

DEV = torchacc.device()


def _models(seed=0):
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(DEV)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _batch(step, n=4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _close(model, ref, what):
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(
            got.cpu(), want.cpu(), rtol=1e-5, atol=1e-6, msg=f"{what}: {name}"
        )


def test_sgd_momentum_with_clipping_matches_eager():
    ref, model = _models()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, max_norm=0.3
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(DEV)), y.to(DEV)).backward()
        opt.step()
        torchacc.sync()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        assert norm > 0.3  # the clipping takes part
        torch.testing.assert_close(opt.grad_norm.cpu(), norm, rtol=1e-5, atol=1e-6)
    _close(model, ref, "ZeRO-1 SGD")
    # the wrapped optimizer holds float32 copies; the model's parameters are not its parameters
    shard = opt.base_optimizer.param_groups[0]["params"][0]
    assert shard is not model[0].weight and shard.shape == model[0].weight.shape
    assert opt.base_optimizer.state[shard]["momentum_buffer"].shape == shard.shape


def test_grad_acc_hook_accumulates_micro_batches_like_eager():
    ref, model = _models(1)
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        grad_clipping=False,
        use_grad_acc_hook=True,
        save_master_weights=True,
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        for micro in range(2):
            x, y = _batch(10 * step + micro)
            nn.functional.mse_loss(model(x.to(DEV)), y.to(DEV)).backward()
            nn.functional.mse_loss(ref(x), y).backward()
            assert model[0].weight.grad is None  # moved into the float32 main_grad
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        ref_opt.step()
        ref_opt.zero_grad()
    _close(model, ref, "ZeRO-1 AdamW, 2 micro-batches")


def test_state_dict_round_trip_resumes_the_same_run():
    ref, model = _models(2)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, save_master_weights=True
    )

    def step(m, o, i):
        x, y = _batch(i)
        o.zero_grad()
        nn.functional.mse_loss(m(x.to(DEV)), y.to(DEV)).backward()
        o.step()
        torchacc.sync()

    step(model, opt, 0)
    saved = opt.state_dict()
    assert set(saved) >= {"state", "param_groups", "base_state", "shape_info"}
    assert saved["shape_info"][0] == model[0].weight.shape
    assert set(saved["sharded_master_weights"]) == {0, 1, 2, 3}
    _ref2, other = _models(3)  # different weights and hyper-parameters, then loaded
    other.load_state_dict(model.state_dict())
    resumed = ZeroRedundancyOptimizer(
        other.parameters(), torch.optim.AdamW, lr=0.5, save_master_weights=True
    )
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == 1e-2
    assert all(p.grad is None for p in other.parameters())
    step(model, opt, 1)
    step(other, resumed, 1)
    _close(other, model, "resumed vs uninterrupted")


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="torchacc device"):
        ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="0-dim parameters"):
        ZeroRedundancyOptimizer([nn.Parameter(torch.zeros((), device=DEV))], torch.optim.SGD)
    params = nn.Linear(2, 2).to(DEV).parameters()
    with pytest.raises(ValueError, match=r"rank 0 is in none of the sharding_groups \[\[1\]\]"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, sharding_groups=[[1]])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero1_two_processes_matches_eager_on_the_whole_batch(tmp_path):
    proc = torchrun("zero1", tmp_path)
    assert proc.returncode == 0, report(proc)
    for rank in range(2):
        got = load(tmp_path, "zero1", rank)
        assert got == {"world": 2, "checks": ["slices", "grad_norm", "params", "state"]}
