"""torchacc.parallel on 4 CPU devices (run by tests/test_parallel.py with CPU_NUM_DEVICES=4).

Every mode trains at parity with eager PyTorch that computes MindSpore's per-device semantics by
hand (the loss of each batch slice, the slice gradients averaged or summed); the seed's semi-auto
example; layouts, per-device bytes and bad input.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from compile_counts import new_graphs  # noqa: E402

import torchacc  # noqa: E402
import torchacc.parallel as par  # noqa: E402
from torchacc.distributed import sharding as engine  # noqa: E402
from torchacc.parallel import ops  # noqa: E402

par.init()
DEV = torchacc.device()
MODES = ["stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel"]


@pytest.fixture(autouse=True)
def fresh_context():
    par.reset_auto_parallel_context()
    yield
    par.reset_auto_parallel_context()


class MLP(torch.nn.Module):
    """Two Linears and a weight used through an op strategy (its columns over 2 devices)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.w3 = torch.nn.Parameter(torch.randn(16, 8) * 0.2)
        self.act = ops.Gelu()
        self.mm = ops.MatMul().shard(((1, 1), (1, 2)))

    def forward(self, x):
        return self.mm(self.fc2(self.act(self.fc1(x))), self.w3)


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _ce(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _mse_sum(out, y):
    return torch.nn.functional.mse_loss(out, y, reduction="sum")


def _reference_step(ref, x, y, loss_fn, slices, mean):
    """MindSpore's semantics by hand: the loss of each device's batch slice, its gradients
    summed over the slices (divided by their number for gradients_mean=True)."""
    losses = []
    for xs, ys in zip(x.chunk(slices), y.chunk(slices)):
        loss = loss_fn(ref(xs), ys)
        loss.backward()
        losses.append(loss.item())
    if mean:
        for p in ref.parameters():
            p.grad /= slices
    return sum(losses) if loss_fn is _mse_sum else sum(losses) / slices


def _train(build, mode, mean, batch, loss_fn, plan=None, budget=None, steps=5, lr=0.05):
    par.set_auto_parallel_context(parallel_mode=mode, gradients_mean=mean)
    if loss_fn is _mse_sum:
        par.set_auto_parallel_context(loss_reduction="sum")
    if budget is not None:
        par.set_auto_parallel_context(device_memory_budget=budget)
    torch.manual_seed(0)
    ref = build()
    model = build()
    model.load_state_dict(ref.state_dict())
    if plan is not None:
        plan(model)
    model = par.parallelize(model.to(DEV))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ropt = torch.optim.SGD(ref.parameters(), lr=lr)
    graphs, losses = [], []
    for step in range(steps):
        x, y = batch(step)
        before = new_graphs()
        loss = loss_fn(model(x.to(DEV)), y.to(DEV))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        graphs.append(new_graphs() - before)
        rloss = _reference_step(ref, x, y, loss_fn, _dp_degree(), mean)
        ropt.step()
        ropt.zero_grad()
        losses.append((loss.item(), rloss))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach().cpu() - q.detach()).abs().max().item()
        assert err <= 1e-5, (mode, mean, name, err)
    for a, b in losses:  # relative beyond 1: a summed loss is in the hundreds
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (mode, mean, losses)
    assert graphs[2:] == [0] * (steps - 2), (mode, graphs)
    return model, losses


def _dp_degree():
    from torchacc.parallel import context

    return context.data_parallel_degree()


def _mlp_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(64, 16, generator=gen), torch.randn(64, 8, generator=gen)


def _mlp_plan(model):
    par.shard(model.fc1, None, parameter_plan={"weight": (2, 1), "bias": (2,)})
    # its input's features over 2 devices, its output's batch over 2 more (4 batch slices)
    par.shard(model.fc2, ((1, 2),), out_strategy=((2, 1),), parameter_plan={"weight": (1, 2)})


@pytest.mark.parametrize("mode", MODES)
def test_mlp_every_mode_matches_eager_for_both_gradients_mean(mode):
    results = {}
    for mean in (True, False):
        plan = _mlp_plan if mode == "semi_auto_parallel" else None
        budget = 12000 if mode == "auto_parallel" else None
        par.reset_auto_parallel_context()
        model, losses = _train(MLP, mode, mean, _mlp_batch, _mse, plan, budget)
        results[mean] = losses
        dp = _dp_degree()
        expect = {"stand_alone": 1, "data_parallel": 4, "semi_auto_parallel": 2}.get(mode, dp)
        assert dp == expect, (mode, dp)
        if mode == "auto_parallel":
            _check_auto_fits(model, 12000)
        if mode in ("semi_auto_parallel", "auto_parallel"):
            # the op strategy split w3's columns over the model-parallel devices
            assert [s[0].shape for s in engine.local_shards(model.w3)] == [(16, 4)] * 4
        if mode == "semi_auto_parallel":  # the module-level parameter plans
            assert [s[0].shape for s in engine.local_shards(model.fc1.weight)] == [(16, 16)] * 4
            assert [s[0].shape for s in engine.local_shards(model.fc2.weight)] == [(16, 16)] * 4
            h = model.fc2(torch.randn(64, 32).to(DEV))  # out_strategy: a constraint on it
            assert tuple(engine.sharding_of(h).spec) == (("dp0", "mp0"), None)
    if _dp_degree() > 1:  # summing the slice gradients is a different training run
        assert results[True][-1] != results[False][-1]


def _check_auto_fits(model, budget):
    table = par.strategy_table(model)
    assert "pure data parallel needs 19200 B per device > budget: layers split" in table, table
    assert "mm (MatMul)" in table and "user op strategy" in table
    per_device = engine.per_device_bytes(list(model.parameters()))
    assert 4 * max(per_device.values()) <= budget, (per_device, table)  # weights, grads, AdamW


def test_summed_loss_with_gradients_mean_divides_by_the_slices():
    """loss_reduction="sum": the whole batch's summed loss is the sum of the slice losses, so
    gradients_mean=True is 1/dp of its gradient (MindSpore's mean of the slice gradients)."""
    _train(MLP, "data_parallel", True, _mlp_batch, _mse_sum, steps=3, lr=1e-3)
    assert par.gradient_scale() == 0.25


def test_seed_example_matmul_strategy_then_reduce_sum():
    par.set_auto_parallel_context(parallel_mode=par.ParallelMode.SEMI_AUTO_PARALLEL)

    class SemiAutoParallelNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(512, 128) / 64)
            self.fc = ops.MatMul().shard(((1, 1), (1, 2)))
            self.reduce = ops.ReduceSum()

        def forward(self, x):
            return self.reduce(self.fc(x, self.weight), -1)

    torch.manual_seed(0)
    net = SemiAutoParallelNet()
    x = torch.randn(8, 512)
    expect = net(x)
    net = par.parallelize(net.to(DEV))
    out = net(x.to(DEV))
    assert torch.allclose(out.cpu(), expect, atol=1e-5, rtol=1e-5)
    shards = engine.local_shards(net.weight)
    assert [tuple(s[0].shape) for s in shards] == [(512, 64)] * 4  # half the columns each
    for data, index, _, _ in shards:
        assert torch.equal(data, net.weight.detach().cpu()[index])
    assert engine.hlo_text(engine.sharding_of(net.weight), 2) == (
        "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
    )


def _gpt():
    from gallery.gpt.model import build_gpt

    return build_gpt("gpt-tiny")


def _gpt_batch(step):
    gen = torch.Generator().manual_seed(200 + step)
    return tuple(torch.randint(0, 512, (8, 16), generator=gen) for _ in range(2))


def _gpt_plan(model):
    for block in model.h:  # Megatron-style: column-split in, row-split out
        par.shard(block.attn.c_attn, None, parameter_plan={"weight": (2, 1), "bias": (2,)})
        par.shard(block.attn.c_proj, None, parameter_plan={"weight": (1, 2)})
        par.shard(block.mlp.c_fc, None, parameter_plan={"weight": (2, 1), "bias": (2,)})
        par.shard(block.mlp.c_proj, None, parameter_plan={"weight": (1, 2)})


@pytest.mark.parametrize("mode", MODES)
def test_gpt_tiny_every_mode_matches_eager_for_both_gradients_mean(mode):
    # one device: sum == mean; the search's gradient hooks are the same code as the others'
    means = (True, False) if mode in ("data_parallel", "semi_auto_parallel") else (False,)
    for mean in means:
        par.reset_auto_parallel_context()
        plan = _gpt_plan if mode == "semi_auto_parallel" else None
        budget = 1_400_000 if mode == "auto_parallel" else None
        model, _ = _train(_gpt, mode, mean, _gpt_batch, _ce, plan, budget, steps=3, lr=0.5)
        if mode == "semi_auto_parallel":
            w = model.h[0].mlp.c_fc.weight
            assert [tuple(s[0].shape) for s in engine.local_shards(w)] == [(128, 64)] * 4
        if mode == "auto_parallel":
            table = par.strategy_table(model)
            assert "lm_head" in table and "parameter shared with another layer" in table, table
            per_device = engine.per_device_bytes(list(model.parameters()))
            assert 4 * max(per_device.values()) <= 1_400_000, (per_device, table)


def test_context_defaults_modes_and_order():
    assert par.get_group_size() == 4 and par.get_rank() == 0
    assert par.get_auto_parallel_context("parallel_mode") == par.ParallelMode.STAND_ALONE
    assert par.get_auto_parallel_context("gradients_mean") is False
    assert par.get_auto_parallel_context("parameter_broadcast") is False
    # touching the device and eager backward passes before the context are fine
    w = torch.ones(3, requires_grad=True)
    (w * 2).sum().backward()
    assert torch.equal((torch.ones(3).to(DEV) * 2).cpu(), w.grad)
    par.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    assert par.get_auto_parallel_context("parallel_mode") == par.ParallelMode.DATA_PARALLEL
    assert par.get_auto_parallel_context("device_num") == 4
    assert par.get_auto_parallel_context("global_rank") == 0
    with pytest.raises(ValueError, match=r"unknown parallel_mode 'model_parallel'.*data_parallel"):
        par.set_auto_parallel_context(parallel_mode="model_parallel")
    with pytest.raises(ValueError, match="device_num=8 but the job has 4 devices"):
        par.set_auto_parallel_context(device_num=8)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gradient_mean'\]"):
        par.set_auto_parallel_context(gradient_mean=True)
    assert par.get_auto_parallel_context("gradients_mean") is True  # nothing half-applied
    par.shard(torch.nn.Linear(4, 4), ((2, 1),))
    with pytest.raises(RuntimeError, match=r"after shard\(\).*before the first training step"):
        par.set_auto_parallel_context(gradients_mean=False)
    par.reset_auto_parallel_context()
    assert par.get_auto_parallel_context("parallel_mode") == par.ParallelMode.STAND_ALONE
    par.set_auto_parallel_context(parallel_mode=par.ParallelMode.SEMI_AUTO_PARALLEL)


def test_bad_strategies_name_the_op_the_shape_and_the_strategy():
    par.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    with pytest.raises(ValueError, match=r"MatMul-op\d+: strategy \(2, 4\) uses 8 devices.*4"):
        ops.MatMul().shard(((1, 1), (2, 4)))
    with pytest.raises(ValueError, match=r"splits one dimension of the op \(k\) into 2 and 1"):
        ops.MatMul().shard(((1, 2), (1, 2)))
    with pytest.raises(ValueError, match="one strategy tuple per input"):
        ops.MatMul().shard((1, 2))
    lin = torch.nn.Linear(6, 4)
    with pytest.raises(ValueError, match=r"Linear.weight: strategy \(1, 4\) splits dimension 1"):
        par.shard(lin, None, parameter_plan={"weight": (1, 4)})
    with pytest.raises(ValueError, match=r"Linear.weight: strategy \(2,\) has 1 entries for "):
        par.shard(lin, None, parameter_plan={"weight": (2,)})
    with pytest.raises(ValueError, match=r"'kernel', which is not a parameter"):
        par.shard(lin, None, parameter_plan={"kernel": (2, 1)})

    class Net(torch.nn.Module):
        def __init__(self, second):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))
            self.a = ops.MatMul().shard(((1, 1), (1, 2)))
            self.b = ops.MatMul().shard(second)

        def forward(self, x):
            return self.b(self.a(x, self.w), self.w)

    def first_step(net, x):
        net = par.parallelize(net.to(DEV))
        before = new_graphs()
        with pytest.raises(ValueError) as info:
            net(x.to(DEV))
        assert new_graphs() == before  # raised before any step ran
        return str(info.value)

    msg = first_step(Net(((1, 2), (2, 1))), torch.randn(4, 8))
    assert "used by a (MatMul) with strategy (1, 2) and by b (MatMul) with strategy (2, 1)" in msg
    assert "(8, 8)" in msg
    par.reset_auto_parallel_context()
    par.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    msg = first_step(Net(((1, 1), (1, 2))), torch.randn(4, 8, 2))
    assert (
        "a (MatMul): strategy ((1, 1), (1, 2)) has 2 entries for an input of shape (4, 8, 2)"
        in (msg)
    )
    par.reset_auto_parallel_context()
    par.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    msg = first_step(Net(((1, 1), (1, 2))), torch.randn(3, 8))
    assert "batch dimension of an input of shape (3, 8)" in msg, msg


def test_checkpoint_slices_merge_and_match_the_merged_file(tmp_path):
    import json

    import ckpt_model

    out = os.environ.get("PARALLEL_CKPT_DIR") or str(tmp_path)
    par.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
    torch.manual_seed(0)
    model = ckpt_model.Wide()
    ckpt_model.plan(model, par)
    model = par.parallelize(model.to(DEV))
    opt = ckpt_model.optimizer(model)
    for i in range(3):
        ckpt_model.step(model, opt, i, DEV, torchacc.sync)
    full = os.path.join(out, "full.ckpt")
    par.save_checkpoint(model, full, opt)
    files = par.save_checkpoint(model, os.path.join(out, "slices"), opt, integrated_save=False)
    assert [os.path.basename(f) for f in files] == [f"device_{d}.ckpt" for d in range(4)]
    assert sorted(os.listdir(os.path.join(out, "slices"))) == sorted(map(os.path.basename, files))
    sizes = [os.path.getsize(f) for f in files]
    assert abs(sum(sizes) - os.path.getsize(full)) <= 0.05 * os.path.getsize(full), sizes
    assert max(sizes) <= 0.4 * sum(sizes), sizes  # each device holds about a quarter
    merged_file = torch.load(full, weights_only=True)["tensors"]
    slots = {"format", "device", "device_num", "tensors", "layout", "param_groups"}
    for d, f in enumerate(files):
        obj = torch.load(f, weights_only=True)  # weights_only-safe
        assert set(obj) <= slots and obj["device"] == d and obj["device_num"] == 4
        for name, piece in obj["tensors"].items():  # only this device's slices
            index = tuple(slice(a, b) for a, b in obj["layout"][name]["index"])
            assert torch.equal(piece, merged_file[name][index])
        w1 = obj["tensors"].get("fc1.weight")
        assert w1 is None or tuple(w1.shape) == (128, 64)
    merged = par.load_checkpoint(os.path.join(out, "slices"))
    assert set(merged) == {k for k in merged_file if not k.startswith("optimizer.")}
    for name, t in merged.items():
        assert torch.equal(t, merged_file[name]), name  # bit-identical
    losses = [ckpt_model.step(model, opt, i, DEV, torchacc.sync) for i in (3, 4)]
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(losses, f)
    with pytest.raises(ValueError, match=r"device\(s\) \[2\] \(of 4 saved\)"):
        par.load_distributed_checkpoint(model, [f for f in files if not f.endswith("_2.ckpt")])


def test_strategy_file_shards_the_layers_it_names(tmp_path):
    from gallery.gpt.model import build_gpt

    path = tmp_path / "gpt.yaml"
    path.write_text(
        "h.*.attn.c_attn: {weight: [2, 1], bias: [2]}\n"
        "h.*.mlp.c_proj: {weight: [1, 2]}\n"
        "lm_head: {in_strategy: [[2, 1, 1]]}\n"
    )
    model = build_gpt("gpt-tiny")
    done = par.apply_strategies(model, par.load_strategy_file(str(path)), str(path))
    assert done == ["h.0.attn.c_attn", "h.1.attn.c_attn", "h.0.mlp.c_proj", "h.1.mlp.c_proj"] + [
        "lm_head"
    ]
    assert model.h[1].attn.c_attn._torchacc_shard.params == {"weight": (2, 1), "bias": (2,)}
    assert model.lm_head._torchacc_shard.inputs == ((2, 1, 1),)
    path.write_text("h.*.attn.qkv: {weight: [2, 1]}\n")
    with pytest.raises(ValueError, match=r"gpt.yaml: 'h.\*.attn.qkv' names no module of GPT"):
        par.apply_strategies(model, par.load_strategy_file(str(path)), str(path))
    path.write_text("lm_head: [2, 1]\n")
    with pytest.raises(ValueError, match="'lm_head' must map parameter names to strategies"):
        par.load_strategy_file(str(path))


def test_every_op_with_a_strategy_matches_eager_forward_and_backward():
    # gradients_mean=True: the whole batch's gradient (False would be dp = 2 times it)
    par.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)

    class OpsNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(32, 16))
            self.w = torch.nn.Parameter(torch.randn(16, 16) * 0.3)
            self.b = torch.nn.Parameter(torch.randn(16))
            self.gather = ops.Gather().shard(((2, 1), (1, 1)))  # vocabulary over 2 devices
            self.bmm = ops.BatchMatMul().shard(((1, 1, 2), (2, 1)))  # contracted dim split
            self.add = ops.Add().shard(((1, 1, 2), (2,)))
            self.softmax = ops.Softmax().shard(((1, 1, 2),))
            self.relu = ops.ReLU().shard(((2, 1, 1),))
            self.mul = ops.Mul().shard(((2, 1, 1), (2, 1, 1)))
            self.gelu = ops.Gelu().shard(((1, 2, 1),))
            self.reduce = ops.ReduceSum().shard(((1, 2, 1),))
            self.mm = ops.MatMul(transpose_b=True).shard(((1, 1), (2, 1)))  # w as bmm splits it

        def forward(self, idx):
            h = self.add(self.bmm(self.gather(self.table, idx), self.w), self.b)
            h = self.gelu(self.mul(self.relu(h), self.softmax(h)))
            return self.mm(self.reduce(h, 1), self.w)

    torch.manual_seed(0)
    ref = OpsNet()
    net = OpsNet()
    net.load_state_dict(ref.state_dict())
    net = par.parallelize(net.to(DEV))
    idx = torch.randint(0, 32, (8, 6))
    out = net(idx.to(DEV))
    out.pow(2).mean().backward()
    torchacc.sync()
    expect = ref(idx)
    expect.pow(2).mean().backward()
    assert torch.allclose(out.cpu(), expect, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5), name
    assert [tuple(s[0].shape) for s in engine.local_shards(net.table)] == [(16, 16)] * 4
    assert [tuple(s[0].shape) for s in engine.local_shards(net.w)] == [(8, 16)] * 4
