"""How much memory a compiled training step takes beside its arguments (its executable's temp
bytes, ``memory_analysis()``): donated buffers go to the results that update them (Note [Donation
pairs] in torchacc/program/key.py), and backward rules recompute from fenced forward values
instead of keeping the forward's float32 intermediates (Note [Backward rules read fenced forward
values] in torchacc/lowering/memory.py). Each case is checked against the same step built without
the mechanism, so the numbers are the compiler's, not hard-coded."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchacc
from torchacc.lowering import memory
from torchacc.program import cache, key

DEV = torchacc.device()


def _step_program(model, batches, run):
    """Train ``model`` on the device over ``batches`` (``run(model, batch)`` gives the loss) with
    AdamW; the losses and the last step program's temp bytes."""
    cache.clear_memory_cache()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = run(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        losses.append(loss.item())
    exe = list(cache._cache.values())[-1]
    return losses, exe.memory_analysis().temp_size_in_bytes


def _mlp_loss(model, x):
    return model(x).square().mean()


def _jax_pairs(arg_avals, donate, result_avals):
    """JAX's rule (``donate_argnums``): walking the results in order, each takes the first donated
    argument not yet taken with its shape and dtype."""
    left = [i for i in donate]
    pairs = {}
    for j, aval in enumerate(result_avals):
        for i in left:
            if arg_avals[i] == aval:
                pairs[j] = i
                left.remove(i)
                break
    return pairs


def test_each_updated_value_takes_its_own_donated_buffer():
    """Arguments: a pack, then weights w0, w1 and their moments in the order a graph walk meets
    them (second moments first); results: the pack, then w0, w1, m0, v0, m1, v1 and a gradient
    of w's shape (storage order). Paired by JAX's shape rule alone, w0's moment m0 would land in
    v0's buffer; the program's order of loose results makes JAX pair each result with the
    argument its storage held (its partner), and the leftover result with no donated buffer."""
    w, pk = ((4, 4), "f32"), ((10,), "f32")
    arg_avals = [pk, w, w, w, w, w, w]  # pack, w0, w1, v0, v1, m0, m1
    flags = (True,) * 7
    names = ["w0", "w1", "m0", "v0", "m1", "v1", "grad"]
    outs = [(j + 1, w) for j in range(7)]  # output 0 is the pack
    partners = [1, 2, 5, 3, 6, 4, None]
    donate, order = key.donations(arg_avals, [pk], outs, flags, partners)
    assert donate == (0, 1, 2, 3, 4, 5, 6)
    assert sorted(order) == [1, 2, 3, 4, 5, 6, 7]
    program_results = [pk] + [w] * 7
    pairs = _jax_pairs(arg_avals, donate, program_results)
    assert pairs[0] == 0, "the pack result takes the pack"
    got = {names[order[k] - 1]: pairs.get(k + 1) for k in range(7)}
    assert got == dict(zip(names, partners)), got
    # a partner no live storage lets go of is not donated; its result takes another free buffer
    flags = (True, True, True, False, True, True, True)  # v0 is held
    donate, order = key.donations(arg_avals, [pk], outs, flags, partners)
    assert 3 not in donate
    pairs = _jax_pairs(arg_avals, donate, [pk] + [w] * 7)
    got = {names[order[k] - 1]: pairs.get(k + 1) for k in range(7)}
    for name, partner in zip(names, partners):
        if partner is not None and partner != 3:
            assert got[name] == partner, (name, got)


class _Block(nn.Module):
    """Pre-norm attention and a tanh-GELU MLP, as GPT-2's block."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class _Tiny(nn.Module):
    def __init__(self, vocab=96, d=64, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[_Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


def _lm_loss(model, batch):
    ids, labels = batch
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def test_backward_rules_do_not_keep_the_forwards_float32_intermediates(monkeypatch):
    """A bf16 GPT-style step: with the fences, the attention probabilities, GELU's float32 tanh,
    layer norm's normalized input and the linear layers' float32 input copies are recomputed in
    the backward instead of living from the forward to it; the losses do not change."""
    torch.manual_seed(0)
    base = _Tiny()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (4, 129), generator=g)
    batches = [(ids[:, :-1].to(DEV), ids[:, 1:].to(DEV)) for _ in range(2)]

    fenced_losses, fenced = _step_program(_copy(base).to(DEV), batches, _lm_loss)
    monkeypatch.setattr(memory, "fenced", lambda saved, grads: list(saved))
    plain_losses, plain = _step_program(_copy(base).to(DEV), batches, _lm_loss)
    monkeypatch.undo()
    torch.testing.assert_close(fenced_losses, plain_losses, rtol=1e-6, atol=0)
    assert fenced <= 0.75 * plain, f"temp bytes {plain} unfenced -> {fenced} fenced"


def _copy(module):
    import copy

    return copy.deepcopy(module)
