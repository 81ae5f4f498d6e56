"""``torchacc.accelerate()`` end to end: bf16 on the lazy backend against eager bf16 autocast with
no new program after step 3, the eager backend identical to plain PyTorch, and ``memory.gc``
checkpointing that really lowers the compiled step's temp memory (Note [Checkpointing that saves
memory] in torchacc/accel/checkpoint.py)."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from compile_counts import new_graphs

import torchacc as ta
import torchacc.torch_xla.core.xla_model as xm
from torchacc import metrics
from torchacc.program import cache


class Block(nn.Module):
    calls = 0

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        Block.calls += 1
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, layers=6, d=32, vocab=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        logits = self.head(self.blocks(self.emb(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _data(steps, batch=4, seq=16, vocab=40):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.roll(-1, 1)})
    return out


def _train(model, loader, steps_done=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in loader:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if steps_done is not None:
            steps_done.append(new_graphs())
    return [float(t) for t in losses]


def test_lazy_bf16_matches_eager_bf16_and_stops_compiling():
    torch.manual_seed(0)
    base = Stack(layers=2)
    data = _data(4)
    # plain PyTorch with its own autocast, and the eager backend: identical
    plain = copy.deepcopy(base)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    expected = []
    for batch in data:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = plain(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    eager_config = ta.Config(backend="eager")
    eager_config.compute.bf16 = True
    model, loader = ta.accelerate(copy.deepcopy(base), data, eager_config)
    assert model.device == torch.device("cpu")
    assert _train(model, loader) == expected, "the eager backend is plain PyTorch"
    # the lazy backend
    config = ta.Config()
    config.compute.bf16 = True
    metrics.clear_all()
    model, loader = ta.accelerate(copy.deepcopy(base), data, config)
    assert all(p.dtype == torch.float32 for p in model.parameters()), "fp32 master weights"
    graphs = []
    losses = _train(model, loader, graphs)
    torch.testing.assert_close(losses, expected, rtol=1e-2, atol=0)
    assert graphs[2] == graphs[-1], f"no new program after step 3: {graphs}"


def _step_temp_bytes(gc, steps=1):
    cache.clear_memory_cache()  # the last program built below is then this run's step
    Block.calls = 0
    torch.manual_seed(0)
    config = ta.Config()
    if gc:
        config.memory.gc = True
        config.memory.gc_cls = {"Block"}
    # d=72: the 72 x 288 weights stay out of the state packs (Note [Packed state]), whose
    # results live until the step's end however the forward is checkpointed
    model, loader = ta.accelerate(Stack(d=72), _data(steps, seq=64), config)
    losses = _train(model, loader)
    executable = list(cache._cache.values())[-1]  # the last program built: a full step's
    return executable.memory_analysis().temp_size_in_bytes, losses, Block.calls


def test_gc_lowers_the_compiled_steps_temp_memory():
    plain_bytes, plain_losses, plain_calls = _step_temp_bytes(gc=False)
    gc_bytes, gc_losses, gc_calls = _step_temp_bytes(gc=True)
    torch.testing.assert_close(gc_losses, plain_losses, rtol=1e-4, atol=1e-5)
    assert plain_calls == 6 and gc_calls == 6 * 2, "each block's forward runs twice"
    assert gc_bytes <= 0.6 * plain_bytes, f"temp bytes {plain_bytes} -> {gc_bytes} with gc"


def test_gc_cnt_checkpoints_the_first_blocks_only():
    Block.calls = 0
    config = ta.Config()
    config.memory.gc, config.memory.gc_cls, config.memory.gc_cnt = True, {"Block"}, 2
    model = ta.accelerate(Stack(), config=config)
    model(**{k: v.to(model.device) for k, v in _data(1)[0].items()}).backward()
    ta.sync()
    assert Block.calls == 6 + 2


def test_optimization_barrier_keeps_values_and_is_one_node():
    dev = ta.device()
    a = torch.arange(6.0).to(dev) * 2
    b = torch.ones(2, 3, dtype=torch.int64).to(dev)
    view = a[1:3]
    xm.optimization_barrier_([a, b, torch.zeros(2)])
    assert a._st.value.node.op.key[0] == torch.ops.torchacc.optimization_barrier.default
    assert a._st.value.node is b._st.value.node, "one barrier over both"
    assert view.tolist() == [2.0, 4.0] and a.tolist() == [0, 2, 4, 6, 8, 10]
    assert b.tolist() == [[1, 1, 1], [1, 1, 1]]


def test_debug_reports_each_new_programs_memory(monkeypatch, capfd):
    monkeypatch.setenv("TORCHACC_DEBUG", "1")
    config = ta.Config()
    config.memory.gc, config.memory.gc_cls = True, {"Block"}
    model, loader = ta.accelerate(Stack(layers=2), _data(2), config)
    _train(model, loader)
    err = capfd.readouterr().err
    assert "torchacc: step program memory: temp " in err, err[-2000:]
    line = next(x for x in err.splitlines() if "step program memory" in x)
    for category in ("aliased ", "outputs not donated ", "host RSS ", "(peak "):
        assert category in line, line


def test_fp16_with_a_grad_scaler_matches_eager_fp16():
    """``compute.fp16``: autocast float16 forward, fp32 weights; ``ta.amp.GradScaler`` with a
    syncfree optimizer on the lazy backend, torch's own on the eager one."""
    torch.manual_seed(0)
    base = Stack(layers=2)
    data = _data(2)
    runs = {}
    for backend in ("eager", "lazy"):
        config = ta.Config(backend=backend)
        config.compute.fp16 = True
        model, loader = ta.accelerate(copy.deepcopy(base), data, config)
        if backend == "lazy":
            opt = ta.amp.syncfree.SGD(model.parameters(), lr=0.1)
            scaler = ta.amp.GradScaler(init_scale=2.0**8)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        losses = []
        for batch in loader:
            loss = model(**batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
        runs[backend] = [float(t) for t in losses]
        assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(runs["lazy"], runs["eager"], rtol=1e-2, atol=0)


def test_acc_scaled_dot_attn_routes_sdpa_inside_the_forward_only(monkeypatch):
    import torchacc_ops

    calls = []
    real = torchacc_ops.flash_attention

    def counting(*args, **kwargs):
        calls.append(kwargs["causal"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torchacc_ops, "flash_attention", counting)

    class Attn(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    config = ta.Config(backend="eager")
    config.compute.acc_scaled_dot_attn = True
    model = ta.accelerate(Attn(), config=config)
    q = torch.randn(1, 2, 4, 8)
    torch.testing.assert_close(model(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert calls == [True], "the model's SDPA ran as flash_attention"


def test_checkpoint_gives_keyword_tensors_their_gradients():
    from torchacc.accel.checkpoint import checkpoint

    dev = ta.device()
    lin = nn.Linear(4, 4).to(dev)

    def f(x, *, y, scale):
        return (lin(x) * y * scale).tanh()

    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        x = torch.randn(2, 4).to(dev).requires_grad_(True)
        y = torch.randn(2, 4).to(dev).requires_grad_(True)
        out = checkpoint(f, x, y=y, scale=3.0) if ckpt else f(x, y=y, scale=3.0)
        out.sum().backward()
        grads.append([x.grad.cpu(), y.grad.cpu()])
        lin.zero_grad()
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_checkpoint_gives_nested_tensors_their_gradients():
    """Tensors inside tuples/dicts of ``args``/``kwargs`` (non-leaves here) are arguments of the
    checkpoint too (saved and fenced like the others): gradients equal the plain function's."""
    from torchacc.accel.checkpoint import checkpoint

    dev = ta.device()

    def f(x, pair, *, extra):
        return (x * pair[0] + pair[1] * extra["w"]).tanh()

    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        x, a, b, w = (torch.randn(2, 4).to(dev).requires_grad_(True) for _ in range(4))
        pair, extra = (a * 2, b + 1), {"w": w.exp()}
        out = checkpoint(f, x, pair, extra=extra) if ckpt else f(x, pair, extra=extra)
        out.sum().backward()
        grads.append([t.grad.cpu() for t in (x, a, b, w)])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want)


def test_gc_of_an_hf_decoder_drops_its_kv_cache_for_the_replay():
    """transformers configs default to ``use_cache=True``, in training too: checkpointing a
    decoder layer by replacing its forward replayed it with the forward's DynamicCache, appending
    its keys a second time (the embedding's gradient was off by 0.48). ``memory.gc`` goes through
    the layer's own checkpointing hook, which runs it without a cache: gradients equal eager's."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    assert cfg.use_cache
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    ref(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for backend in ("lazy", "eager"):
        model = copy.deepcopy(ref)
        model.zero_grad()
        config = ta.Config(backend=backend)
        config.memory.gc, config.memory.gc_cls = True, {"LlamaDecoderLayer"}
        model = ta.accelerate(model, config=config)
        assert all(layer.gradient_checkpointing for layer in model.model.layers)
        dev_ids = ids.to(model.device)
        model(input_ids=dev_ids, labels=dev_ids).loss.backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.cpu(), want[n], rtol=1e-4, atol=1e-5, msg=n)
