"""Pipeline parallel on 4 CPU devices (run by tests/test_pipeline.py with CPU_NUM_DEVICES=4):
``ta.dist.PipelineParallel`` / ``pipeline_parallel`` against the unpipelined eager model (losses,
gradients, updates; GPipe and 1F1B), per-device parameter bytes, no recompile after step 2,
pp x dp and pp x fsdp, gc + bf16, skips and tied weights across stages, accelerate, bad input;
uniform stages: pp x tp and pp x sp on a GPT-2-shaped model (torchacc/pipeline/uniform.py).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from compile_counts import new_graphs  # noqa: E402

import torchacc as ta  # noqa: E402
from torchacc import metrics  # noqa: E402
from torchacc.pipeline import pipeline_parallel  # noqa: E402
from torchacc.sharding import api  # noqa: E402

D, V, B, T = 16, 32, 8, 5


class Block(torch.nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(torch.nn.Module):
    def __init__(self, layers=4, tied=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class SkipNet(torch.nn.Module):  # TorchAcc's tests/standalone/pipeline.py --test_skip, smaller
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = (torch.nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        x1 = self.fc1(x)
        x2 = self.fc2(x1)
        x3 = self.fc3(x1)
        x4 = self.fc4(x2)
        return x3 + x4


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def mse(out, labels):
    return ((out - labels) ** 2).mean()


def _data(seed=0, b=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)


def _pair(make=Net, **kw):
    torch.manual_seed(0)
    ref, model = make(**kw), make(**kw)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _max_err(pm, ref, grads):
    got = pm.unpacked(grads=grads)
    worst = 0.0
    for name, p in ref.named_parameters():
        want = p.grad if grads else p.detach()
        worst = max(worst, float((got[name].cpu().float() - want).abs().max()))
    return worst


def _train(pm, ref, steps, out_fn=loss_fn, data=_data, lr=0.1):
    """``steps`` SGD steps on both; per step (loss error, grad error); then the param error."""
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    dev = ta.device()
    errs = []
    for s in range(steps):
        x, y = data(s)
        ref_opt.zero_grad()
        want = out_fn(ref(x), y)
        want.backward()
        opt.zero_grad()
        loss = pm.forward_backward(x.to(dev), labels=y.to(dev), output_fn=out_fn)
        ta.sync()
        errs.append((abs(float(loss) - float(want)), _max_err(pm, ref, grads=True)))
        opt.step()
        ref_opt.step()
        ta.sync()
    return errs, _max_err(pm, ref, grads=False)


def _mesh(shape, names):
    api.use_spmd()
    return api.jax_mesh(range(4), shape, names)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_losses_gradients_updates_equal_eager_and_no_recompile(schedule):
    """pp=4, 4 micro-batches: 3 SGD steps equal the unpipelined model's (loss, every gradient,
    the updated parameters) within 1e-5 fp32; nothing compiles after step 2."""
    ref, model = _pair()
    pm = pipeline_parallel(
        model, _mesh([4], ["pp"]), ["blocks.1", "blocks.2", "blocks.3"], 4, schedule
    )
    pm.to(ta.device())
    errs, param_err = _train(pm, ref, 2)
    metrics.clear_all()
    more, param_err = _train(pm, ref, 1)
    assert new_graphs() == 0, metrics.short_metrics_report()
    for loss_err, grad_err in errs + more:
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (errs, more)
    assert param_err <= 1e-5


def test_per_device_parameter_bytes_are_one_stage():
    """4 equal blocks on pp=4: each device holds its stage's parameters only (<= 1/pp + 10%
    of the model's), read from the arrays' shardings."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    total = sum(p.numel() * 4 for p in model.parameters())
    pm = pipeline_parallel(model, _mesh([4], ["pp"]), ["1", "2", "3"], 2, "1F1B")
    pm.to(ta.device())
    per = api.per_device_bytes(list(pm.parameters()))
    assert len(per) == 4 and max(per.values()) <= total / 4 * 1.1, (per, total)
    x = torch.randn(8, 64)
    pm.forward_backward(x.to(ta.device()), labels=x.to(ta.device()), output_fn=mse)
    ta.sync()
    grads = api.per_device_bytes([p.grad for p in pm.parameters()])
    assert max(grads.values()) <= total / 4 * 1.1, grads


@pytest.mark.parametrize("axis", ["dp", "fsdp"])
def test_pp_by_dp_or_fsdp_equals_eager(axis):
    """pp=2 x dp=2 / fsdp=2 through ta.dist.PipelineParallel and the Config: 2 steps equal
    the eager model; under fsdp each packed row is also split over fsdp."""
    ref, model = _pair(layers=2)
    config = ta.Config()
    config.dist.pp.size = 2
    config.dist.pp.num_micro_batches = 2
    config.dist.pp.split_points = [model.blocks[1]]
    config.dist.pp.schedule = "1F1B" if axis == "dp" else "GPipe"
    getattr(config.dist, axis).size = 2
    if axis == "dp":
        config.dist.dp.size = 2
    pm = ta.dist.PipelineParallel(model, config)
    assert isinstance(pm, ta.dist.ParallelModule)
    pm.to(ta.device())
    assert dict(pm.mesh().shape) == {
        "dp": 2 if axis == "dp" else 1,
        "fsdp": 2 if axis == "fsdp" else 1,
        "pp": 2,
    }
    if axis == "fsdp":
        spec = api.sharding_of(pm.packed_0).spec
        assert tuple(spec) == ("pp", "fsdp"), spec
    errs, param_err = _train(pm, ref, 2)
    for loss_err, grad_err in errs:
        assert loss_err <= 1e-5 and grad_err <= 1e-5, errs
    assert param_err <= 1e-5
    if axis == "dp":  # forward(): the mean loss, no gradients
        x, y = _data(5)
        with torch.no_grad():
            loss = pm.forward(x.to(ta.device()), labels=y.to(ta.device()), output_fn=loss_fn)
            want = loss_fn(ref(x), y)
        assert abs(float(loss) - float(want)) <= 1e-5


def test_skip_connections_and_tied_weights_across_stages():
    """TorchAcc's SkipNet split (fc2 | fc3 | fc4: x1 crosses two stages) and a model whose head
    is tied to its embedding (read by the first and last stage: replicated, gradient summed)."""
    ref, model = _pair(SkipNet)
    pm = pipeline_parallel(model, _mesh([4], ["pp"]), ["fc2", "fc3", "fc4"], 2, "1F1B")
    pm.to(ta.device())

    def data(s):
        g = torch.Generator().manual_seed(s)
        return torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)

    errs, param_err = _train(pm, ref, 1, out_fn=mse, data=data)
    assert max(max(e) for e in errs) <= 1e-5 and param_err <= 1e-5, errs
    ref, model = _pair(tied=True)
    pm = pipeline_parallel(model, _mesh([2, 2], ["dp", "pp"]), ["blocks.2"], 2, "GPipe")
    pm.to(ta.device())
    assert pm._shared_names == ["emb.weight"]
    errs, param_err = _train(pm, ref, 1)
    assert max(max(e) for e in errs) <= 1e-5 and param_err <= 1e-5, errs


def test_gradient_checkpointing_and_bf16():
    """TorchAcc's script order: wrap, gradient_checkpoint the underlay model, to(device), then
    forward_backward under torch.cuda.amp.autocast(bf16): the stages run recomputed
    (jax.checkpoint) in bf16; loss and gradients stay within bf16 error of fp32 eager."""
    import torchacc.utils.checkpoint as checkpoint

    ref, model = _pair()
    config = ta.Config()
    config.dist.pp.size = 2
    config.dist.pp.num_micro_batches = 2
    config.dist.pp.split_points = ["blocks.2"]
    pm = ta.dist.PipelineParallel(model, config)
    under = checkpoint.gradient_checkpoint(pm._get_underlay_model(), {"Block"})
    pm._update_underlay_model(under)
    pm.to(ta.device())
    x, y = _data()
    want = loss_fn(ref(x), y)
    want.backward()
    with torch.cuda.amp.autocast(dtype=torch.bfloat16):
        loss = pm.forward_backward(x.to(ta.device()), labels=y.to(ta.device()), output_fn=loss_fn)
    ta.sync()
    assert pm.plan.remat
    assert abs(float(loss) - float(want)) <= 2e-2
    got = pm.unpacked(grads=True)
    for name, p in ref.named_parameters():
        assert float((got[name].cpu() - p.grad).abs().max()) <= 2e-2, name


def test_accelerate_with_pp_and_dp():
    """ta.accelerate with dist.pp.size = 2 (dp = 2 by the device count) returns the pipelined
    model; one step equals eager."""
    ref, model = _pair(layers=2)
    config = ta.Config()
    config.dist.pp.size = 2
    config.dist.pp.num_micro_batches = 2
    config.dist.pp.split_points = ["blocks.1"]
    pm = ta.accelerate(model, config=config)
    assert dict(pm.mesh().shape)["dp"] == 2 and pm.num_stages == 2
    errs, param_err = _train(pm, ref, 1)
    assert max(max(e) for e in errs) <= 1e-5 and param_err <= 1e-5, errs


def test_bad_input_is_one_value_error_naming_the_sizes_and_changes_nothing():
    ref, model = _pair()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = ta.Config()
    config.dist.pp.size = 4
    config.dist.pp.split_points = ["blocks.1", "blocks.2"]
    with pytest.raises(ValueError, match=r"pp.size=4 .* 2 split points"):
        ta.dist.PipelineParallel(model, config)
    config.dist.pp.split_points = ["blocks.1", "blocks.9", "blocks.3"]
    with pytest.raises(ValueError, match=r"'blocks.9' names no module .*4 stages"):
        ta.dist.PipelineParallel(model, config)
    with pytest.raises(ValueError, match="pp.size=2 needs"):
        pipeline_parallel(model, _mesh([2, 2], ["dp", "pp"]), ["blocks.1", "blocks.2"], 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.blocks[1]) is Block and "forward" not in vars(model.blocks[1])
    config.dist.pp.split_points = ["blocks.1", "blocks.2", "blocks.3"]
    config.dist.pp.num_micro_batches = 3
    pm = ta.dist.PipelineParallel(model, config)
    pm.to(ta.device())
    ta.sync()
    rows = pm.packed_0.cpu().clone()
    x, y = _data()
    with pytest.raises(ValueError, match=r"num_micro_batches=3 does not divide the batch size 8"):
        pm.forward_backward(x.to(ta.device()), labels=y.to(ta.device()), output_fn=loss_fn)
    ta.sync()
    assert pm.packed_0.grad is None and torch.equal(pm.packed_0.cpu(), rows)


# ---------------------------------------------------------------------------------------------
# uniform stages (torchacc/pipeline/uniform.py): tp and sp inside the stages, blocks scanned


def _gpt(layers=4, heads=4, d=32, vocab=V, seq=8):
    """A GPT-2-shaped model of the gallery's Blocks (fused c_attn, c_fc -> c_proj), untied."""
    from gallery.gpt.model import Block as GPTBlock
    from gallery.gpt.model import GPTConfig

    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=d)

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(vocab, d)
            self.wpe = torch.nn.Embedding(seq, d)
            self.h = torch.nn.ModuleList(GPTBlock(cfg) for _ in range(layers))
            self.ln_f = torch.nn.LayerNorm(d)
            self.lm_head = torch.nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.h:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    ref, model = GPT(), GPT()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _seq_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, 8), generator=g), torch.randint(0, V, (B, 8), generator=g)


def test_pp_by_tp_gpt_shaped_equals_eager_no_recompile_one_stage_slice_per_device():
    """fsdp x tp x pp x cp = 1 x 2 x 2 x 1: a GPT-2-shaped model of 4 gallery Blocks, 2 per
    stage as one scan, Megatron pairs split over tp inside each stage (1F1B, 2 micro-batches):
    3 SGD steps equal eager (loss, every gradient, the updates) within 1e-5 fp32, nothing
    compiles after step 2, and each device holds 1/(pp x tp) + 10% of the parameters and
    gradients (the blocks' split over pp and Megatron's tp, the prologue's and epilogue's split
    over pp x tp on dim 0)."""
    from torchacc.pipeline.uniform import UniformPipelineModule

    ref, model = _gpt()
    pm = pipeline_parallel(model, _mesh([2, 2], ["pp", "tp"]), ["h.2"], 2, "1F1B")
    assert isinstance(pm, UniformPipelineModule)
    pm.to(ta.device())
    assert tuple(api.sharding_of(pm.stacked_0).spec)[:2] == ("pp", None)
    specs = {r: tuple(api.sharding_of(p).spec) for r, p in zip(pm._rel, pm._packed())}
    assert specs["attn.c_attn.weight"] == ("pp", None, "tp", None), specs
    assert specs["attn.c_proj.weight"] == ("pp", None, None, "tp"), specs
    errs, _ = _train(pm, ref, 2, data=_seq_data)
    metrics.clear_all()
    more, param_err = _train(pm, ref, 1, data=lambda s: _seq_data(s + 2))
    assert new_graphs() == 0, metrics.short_metrics_report()
    for loss_err, grad_err in errs + more:
        assert loss_err <= 1e-5 and grad_err <= 1e-5, (errs, more)
    assert param_err <= 1e-5
    blocks = sum(p.numel() * 4 for n, p in ref.named_parameters() if n.startswith("h."))
    per = api.per_device_bytes(pm._packed())
    assert len(per) == 4 and max(per.values()) <= blocks / 4 * 1.1, (per, blocks)
    assert pm.param_bytes_per_stage() == max(per.values())
    total = sum(p.numel() * 4 for p in ref.parameters())
    per = api.per_device_bytes(list(pm.parameters()))  # prologue / epilogue split over pp x tp
    assert max(per.values()) <= total / 4 * 1.1, (per, total)
    grads = api.per_device_bytes([p.grad for p in pm.parameters()])
    assert max(grads.values()) <= total / 4 * 1.1, grads


def test_pp_by_sp_gpt_shaped_equals_eager():
    """pp = 2 x sp = 2 (context parallel inside the stages: the sequence split on sp, the
    blocks' causal attention cp's ring / Ulysses region nested in the pipeline region), 1F1B:
    one step equals eager within 1e-5 fp32; GPipe under sp is refused by name."""
    ref, model = _gpt(layers=2)
    mesh = _mesh([2, 2], ["pp", "sp"])
    with pytest.raises(NotImplementedError, match=r"sp.size=2: the GPipe schedule"):
        pipeline_parallel(model, mesh, ["h.1"], 2, "GPipe")
    pm = pipeline_parallel(model, mesh, ["h.1"], 2, "1F1B")
    pm.to(ta.device())
    errs, param_err = _train(pm, ref, 1, data=_seq_data)
    assert max(max(e) for e in errs) <= 1e-5 and param_err <= 1e-5, errs


def test_scan_layers_under_pp_by_dp_gpipe_equals_eager():
    """scan_layers=True without tp / sp (dp = 2 x pp = 2, GPipe): uniform stages, each stage's 2
    blocks one scan; one step equals eager within 1e-5 fp32."""
    from torchacc.pipeline.uniform import UniformPipelineModule

    ref, model = _gpt()
    mesh = _mesh([2, 2], ["dp", "pp"])
    pm = pipeline_parallel(model, mesh, ["h.2"], 2, "GPipe", scan_layers=True)
    assert isinstance(pm, UniformPipelineModule)
    pm.to(ta.device())
    errs, param_err = _train(pm, ref, 1, data=_seq_data)
    assert max(max(e) for e in errs) <= 1e-5 and param_err <= 1e-5, errs


def test_uniform_stages_bad_input_is_one_value_error_naming_the_sizes():
    """tp not dividing the heads, split points off the every-L/pp-th block, pp not dividing
    the blocks: one ValueError each naming the sizes; the model is unchanged."""
    ref, model = _gpt(heads=2, d=16)
    ref3, model3 = _gpt(heads=3, d=24)
    before = {k: v.clone() for k, v in model3.state_dict().items()}
    tp = _mesh([2, 2], ["pp", "tp"])
    with pytest.raises(
        ValueError, match=r"tp size 2 does not divide the attention heads .*3 heads"
    ):
        pipeline_parallel(model3, tp, ["h.2"], 2)
    assert all(torch.equal(before[k], v) for k, v in model3.state_dict().items())
    with pytest.raises(ValueError, match=r"2 stages of 2 Block blocks each split before \['h.2'\]"):
        pipeline_parallel(model, tp, ["h.1"], 2)
    ref5, model5 = _gpt(layers=5, heads=2, d=16)
    with pytest.raises(ValueError, match=r"pp.size=2 does not divide the 5 Block blocks"):
        pipeline_parallel(model5, tp, ["h.2"], 2)
    # ta.accelerate with dist.pp x dist.tp: the uniform stages on a (dp, pp, sp, tp) mesh
    from torchacc.pipeline.uniform import UniformPipelineModule

    config = ta.Config()
    config.dist.pp.size = config.dist.tp.size = 2
    config.dist.pp.split_points = ["h.2"]
    pm = ta.accelerate(model, config=config)
    assert isinstance(pm, UniformPipelineModule)
    assert dict(pm.mesh().shape) == {"dp": 1, "pp": 2, "sp": 1, "tp": 2}


def test_launcher_pp_by_cp_front_door_builds_uniform_stages_of_chained_llama(monkeypatch, capsys):
    """The launcher's ``--fsdp --compiler-opt --pp 2 --cp 2`` front door on llama-tiny (no step
    run): ``Llama.chained()`` (each block its rotary tables) equals the model in eager fp32, and
    is cut into uniform stages on a (dp, pp, sp, tp) = (1, 2, 2, 1) mesh, the batch split over
    dp only; ``--packing`` there is refused by name."""
    import logging
    from argparse import Namespace

    from gallery.common.exits import Reported
    from gallery.common.frontdoors.pipeline import Pipeline
    from gallery.llama.model import build_llama
    from torchacc.pipeline.uniform import UniformPipelineModule

    monkeypatch.setenv("RANK", "0")
    torch.manual_seed(0)
    model = build_llama("llama-tiny")
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model.chained()(idx), model(idx), rtol=0, atol=1e-5)
    args = Namespace(
        pp=2, tp=1, cp=2, mesh=None, num_micro_batches=None, batch_size=8, pp_schedule="1F1B"
    )
    door = Pipeline(Namespace(**vars(args), packing=True), logging.getLogger("case"))
    with pytest.raises(Reported):
        door.pipeline(model)
    assert (
        "--pp 2 --cp 2 --packing: uniform stages compute LLaMA's rotary" in capsys.readouterr().err
    )
    door = Pipeline(Namespace(**vars(args), packing=False), logging.getLogger("case"))
    pm = door.pipeline(model)
    assert isinstance(pm, UniformPipelineModule) and pm.split_points == ["model.layers.1"]
    assert dict(pm.mesh().shape) == {"dp": 1, "pp": 2, "sp": 2, "tp": 1}
    assert door.batch_axes == ("dp",) and door.summary[:5] == (1, 1, 2, 1, 2)
