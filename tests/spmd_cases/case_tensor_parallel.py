"""Megatron tensor parallelism on 4 CPU devices (run by tests/test_tensor_parallel.py with
CPU_NUM_DEVICES=4): ``Config.dist.tp`` on the gallery GPT-2 and LLaMA (column->row pairs, Note
[Megatron pairs] in torchacc/sharding/recipes.py), torch's ``parallelize_module`` plans, and the
all-reduces the partitioner puts in the compiled programs."""

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torchacc as ta  # noqa: E402
from gallery.gpt.model import build_gpt  # noqa: E402
from gallery.llama.model import Llama, LlamaConfig, build_llama  # noqa: E402
from torchacc.program import cache  # noqa: E402
from torchacc.sharding import api as engine  # noqa: E402

B, T, VOCAB = 4, 16, 512
COLLECTIVE = re.compile(
    r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def _llama4():  # LLaMA-tiny with 4 key/value heads, so that tp = 4 divides them
    return Llama(
        LlamaConfig(
            vocab_size=VOCAB,
            block_size=64,
            n_layer=2,
            n_head=4,
            n_kv_head=4,
            n_embd=64,
            intermediate=176,
        )
    )


MODELS = {
    ("gpt", 2): lambda: build_gpt("gpt-tiny"),
    ("gpt", 4): lambda: build_gpt("gpt-tiny", n_head=4),
    ("llama", 2): lambda: build_llama("llama-tiny"),
    ("llama", 4): _llama4,
}


def _pair(kind, tp):
    torch.manual_seed(0)
    ref, model = MODELS[kind, tp](), MODELS[kind, tp]()
    model.load_state_dict(ref.state_dict())
    return ref, model


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (B, T + 1), generator=g) for _ in range(n)]


def _train(model, batches, device=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # AdamW would amplify 1e-9 gradients
    losses = []
    for ids in batches:
        if device is not None:
            ids = ids.to(device)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device is not None:
            ta.sync()
        losses.append(loss.item())
    return losses


def _accelerate(model, tp):
    config = ta.Config()
    config.dist.tp.size = tp  # dp = 4 / tp
    return ta.accelerate(model, config=config)


def _collectives():
    """[(op, result shape)] of the collectives of the last compiled program (per device); the
    test clears the in-memory cache first (``cache.clear_memory_cache()``), so that its program
    is compiled, not found."""
    text = next(reversed(cache._cache.values())).as_text()
    return [(m.group(2), m.group(1)) for m in COLLECTIVE.finditer(text)]


def _spec(p):
    return tuple(engine.sharding_of(p).spec)


@pytest.mark.parametrize("kind,tp", sorted(MODELS))
def test_megatron_tp_trains_like_eager(kind, tp):
    ref, model = _pair(kind, tp)
    batches = _batches()
    model = _accelerate(model, tp)
    losses = _train(model, batches, model.device)
    ref_losses = _train(ref, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.detach().cpu() - q.detach()).abs().max().item() <= 1e-5, name
    blocks = model.h if kind == "gpt" else model.layers
    attn, mlp = blocks[0].attn, blocks[0].mlp
    if kind == "gpt":
        column, row = [attn.c_attn, mlp.c_fc], [attn.c_proj, mlp.c_proj]
    else:
        column = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        row = [attn.o_proj, mlp.down_proj]
    for layer in column:
        assert _spec(layer.weight)[:2] == ("tp", None)
        per_device = engine.per_device_bytes([layer.weight])
        assert set(per_device.values()) == {layer.weight.numel() * 4 // tp}
    for layer in row:
        assert _spec(layer.weight)[:2] == (None, "tp")


@pytest.mark.parametrize("kind,tp", [("gpt", 2), ("llama", 4)])
def test_one_all_reduce_of_b_s_h_per_attention_and_per_mlp(kind, tp):
    """The forward program's only collectives are the row layers' all-reduces: 2 per block, each
    of the block's output on a device, (B / dp) x T x h fp32 (Megatron's 2 b*s*h per block)."""
    _, model = _pair(kind, tp)
    model = _accelerate(model, tp)
    cache.clear_memory_cache()
    ids = torch.randint(0, VOCAB, (B, T)).to(model.device)
    with torch.no_grad():
        out = model(ids)
    ta.sync()
    del out
    dp, h, layers = 4 // tp, 64, 2
    found = _collectives()
    assert found == [("all-reduce", f"f32[{B // dp},{T},{h}]{{2,1,0}}")] * (2 * layers), found


def test_tp_not_dividing_the_heads_is_one_error_and_changes_nothing():
    model = build_gpt("gpt-tiny")  # 2 heads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"tp size 4 does not divide the attention heads .*2 heads"
    ):
        _accelerate(model, 4)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        block_size=64,
        n_layer=1,
        n_head=4,
        n_kv_head=4,
        n_embd=64,
        intermediate=170,
    )
    with pytest.raises(ValueError, match=r"tp size 4 does not divide the MLP hidden size .*170"):
        _accelerate(Llama(cfg), 4)
    with pytest.raises(ValueError, match=r"tp size 4 does not divide the key/value heads .*2 key"):
        _accelerate(build_llama("llama-tiny"), 4)


def _torch_plan(layers, sequence_parallel=False):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        col, row = ColwiseParallel(), RowwiseParallel()
        return {
            f"{layers}.*.attn.q_proj": col,
            f"{layers}.*.attn.k_proj": col,
            f"{layers}.*.attn.v_proj": col,
            f"{layers}.*.attn.o_proj": row,
            f"{layers}.*.mlp.gate_proj": col,
            f"{layers}.*.mlp.up_proj": col,
            f"{layers}.*.mlp.down_proj": row,
        }
    # torchtitan's sequence-parallel LLaMA plan: norms on sequence shards, the column layers
    # gather the sequence, the row layers scatter it back
    col_sp, row_sp = ColwiseParallel(), RowwiseParallel(output_layouts=Shard(1))
    return {
        f"{layers}.*.input_norm": SequenceParallel(),
        f"{layers}.*.post_attn_norm": SequenceParallel(),
        **{f"{layers}.*.attn.{n}_proj": col_sp for n in "qkv"},
        f"{layers}.*.attn.o_proj": row_sp,
        f"{layers}.*.mlp.gate_proj": col_sp,
        f"{layers}.*.mlp.up_proj": col_sp,
        f"{layers}.*.mlp.down_proj": row_sp,
    }


def _tp_mesh():
    """A 1-D ``tp`` mesh of the 4 torchacc devices, torch_xla's way."""
    import torchacc.torch_xla.distributed.spmd as xs

    return xs.Mesh(range(4), (4,), ("tp",))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_parallelize_module_plan_on_a_torchacc_mesh(sequence_parallel):
    from torchacc.sharding import recipes

    torch.manual_seed(0)
    ref, model = _llama4(), _llama4()
    model.load_state_dict(ref.state_dict())
    engine.use_spmd()
    model = model.to(ta.device())
    recipes.parallelize_module(model, _tp_mesh(), _torch_plan("layers", sequence_parallel))
    assert _spec(model.layers[1].attn.q_proj.weight) == ("tp", None)
    assert _spec(model.layers[1].mlp.down_proj.weight) == (None, "tp")
    batches = _batches()
    losses = _train(model, batches, ta.device())
    ref_losses = _train(ref, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    cache.clear_memory_cache()
    with torch.no_grad():
        out = model(batches[0][:, :-1].to(ta.device()))
    ta.sync()
    del out
    ops = [op for op, _ in _collectives()]
    if sequence_parallel:
        # per block and sub-block: the sequence all-gathered before the column layers, the row
        # layer's sum reduced onto sequence shards (XLA:CPU keeps it an all-reduce and a slice;
        # XLA:GPU's reduce-scatter pass fuses them)
        assert ops == ["all-gather", "all-reduce"] * 4, ops
        norm = model.layers[1].post_attn_norm
        assert _spec(norm.weight) in ((), (None,))  # norms' parameters stay whole
    else:
        assert ops == ["all-reduce"] * 4, ops


def test_parallelize_module_bad_plan_changes_nothing():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    from torchacc.sharding import recipes

    engine.use_spmd()
    model = _llama4().to(ta.device())
    with pytest.raises(ValueError, match="names no submodule"):
        recipes.parallelize_module(
            model,
            _tp_mesh(),
            {"layers.0.attn.q_proj": ColwiseParallel(), "nope": ColwiseParallel()},
        )
    with pytest.raises(ValueError, match="PrepareModuleInput is not supported"):
        recipes.parallelize_module(model, _tp_mesh(), {"layers.0": PrepareModuleInput()})
    assert not any(_spec(model.layers[0].attn.q_proj.weight))  # nothing was sharded


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_training_step_moves_no_activation_but_the_row_layers_sums(kind):
    """forward + backward + SGD at tp 4: every collective of the step is an all-reduce over tp
    of a block's b x s x h (at most Megatron's 2 forward + 2 backward per block) or of one
    element (the checkpoint fence's predicate, Note [Backward rules read fenced forward
    values]); no activation is all-gathered."""
    _, model = _pair(kind, 4)
    model = _accelerate(model, 4)
    cache.clear_memory_cache()
    _train(model, _batches(2), model.device)
    found = _collectives()
    big = [c for c in found if c != ("all-reduce", f"f32[{B},{T},64]{{2,1,0}}")]
    assert all(op == "all-reduce" and re.fullmatch(r"f32\[1(,1)*\]\S*", s) for op, s in big), found
    assert 2 * 2 <= len(found) - len(big) <= 4 * 2, found


def test_torchs_own_parallelize_module_on_an_xla_device_mesh():
    """torch's ``torch.distributed.tensor.parallel.parallelize_module`` with torchtitan's
    sequence-parallel LLaMA plan on ``init_device_mesh("xla", (4,))`` (torch_xla's way, through
    the alias): its ``distribute_module`` / ``distribute_tensor`` calls reach torchacc's
    ``xla_distribute_*``, the styles' input/output hooks become layouts, the parameters stay
    plain torchacc parameters; training equals eager within 1e-5."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import torchacc.alias  # noqa: F401  (``import torch_xla`` is torchacc's, as for torch_xla)

    torch.manual_seed(0)
    ref, model = _llama4(), _llama4()
    model.load_state_dict(ref.state_dict())
    from torchacc.torch_xla.distributed.spmd import XLAShardedTensor

    engine.use_spmd()
    model = model.to(ta.device())
    mesh = init_device_mesh("xla", (4,), mesh_dim_names=("tp",))
    model = parallelize_module(model, mesh, _torch_plan("layers", sequence_parallel=True))
    q = model.layers[1].attn.q_proj.weight
    assert not any(isinstance(p, XLAShardedTensor) for p in model.parameters())
    assert type(q) is type(model.embed.weight) and q.device.type == ta.device().type
    assert _spec(q) == ("tp", None)
    assert _spec(model.layers[1].mlp.down_proj.weight) == (None, "tp")
    batches = _batches()
    losses = _train(model, batches, ta.device())
    ref_losses = _train(ref, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.detach().cpu() - r.detach()).abs().max().item() <= 1e-5, name
    cache.clear_memory_cache()
    with torch.no_grad():
        out = model(batches[0][:, :-1].to(ta.device()))
    ta.sync()
    del out
    assert [op for op, _ in _collectives()] == ["all-gather", "all-reduce"] * 4


class _Megatron(torch.nn.Module):
    """A column layer and a row layer of one shape (o_proj and q_proj are both h x h), and a
    replicated norm."""

    def __init__(self, h=16):
        super().__init__()
        self.up = torch.nn.Linear(h, h, bias=False)
        self.down = torch.nn.Linear(h, h, bias=False)
        self.norm = torch.nn.LayerNorm(h)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def test_gradients_and_adamw_state_keep_their_parameters_layout():
    """Note [A new result's layout] (torchacc/sharding/layout.py): at tp 2 x dp 2, each gradient
    (new every step: ``zero_grad()`` sets it to None) and AdamW moment comes out laid out like its
    own parameter, not like another parameter of the same shape and dtype; the steady step
    compiles once and its only collectives are the math's all-reduces (nothing is resharded);
    training equals eager."""
    import numpy as np

    import torchacc.torch_xla.distributed.spmd as xs

    torch.manual_seed(0)
    ref, model = _Megatron(), _Megatron()
    model.load_state_dict(ref.state_dict())
    engine.use_spmd()
    dev = ta.device()
    model = model.to(dev)
    mesh = xs.Mesh(np.arange(4), (2, 2), ("dp", "tp"))
    xs.mark_sharding(model.up.weight, mesh, ("tp", None))
    xs.mark_sharding(model.down.weight, mesh, (None, "tp"))
    specs = {name: _spec(p) for name, p in model.named_parameters()}
    assert specs["up.weight"] != specs["down.weight"]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    g = torch.Generator().manual_seed(1)
    programs = []
    for step in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        for m, opt, on in ((model, opts[0], True), (ref, opts[1], False)):
            opt.zero_grad()
            xd, yd = (x.to(dev), y.to(dev)) if on else (x, y)
            if on:
                xs.mark_sharding(xd, mesh, ("dp", None))
            (m(xd) - yd).pow(2).mean().backward()
            opt.step()
        before = len(cache._cache)
        ta.sync()
        programs.append(len(cache._cache) - before)
        for name, p in model.named_parameters():
            state = opts[0].state[p]
            got = [_spec(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            assert got == [specs[name]] * 4, (step, name, got)
    assert programs[2:] == [0, 0], programs  # the steady step (from step 2) compiles once
    found = {op for op, _ in _collectives()}
    assert found == {"all-reduce"}, found  # no all-gather / all-to-all moving state
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.detach().cpu() - r.detach()).abs().max().item() <= 1e-5, name
