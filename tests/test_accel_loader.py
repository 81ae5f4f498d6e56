"""``torchacc.AsyncLoader`` and bucketing (Note [Bucketing] in torchacc/accel/loader.py): TorchAcc's
padding rule exactly, batches on the device with one sync per batch, and a variable-length
training run through ``accelerate()`` that compiles one program per bucket and matches eager
PyTorch on the unpadded batches."""

import random
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from compile_counts import new_graphs

import torchacc as ta
from torchacc import metrics


def _batch(length, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (batch, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_the_bucketing_rule():
    loader = ta.AsyncLoader([_batch(5), _batch(8), _batch(9), _batch(1)], "cpu", buckets=[16, 8])
    assert loader.buckets == [8, 16], "given buckets are sorted"
    out = list(loader)
    assert [b["input_ids"].shape[-1] for b in out] == [8, 8, 16, 8], "smallest bucket >= length"
    first = out[0]
    src = _batch(5)
    assert torch.equal(first["input_ids"][:, :5], src["input_ids"])
    assert torch.equal(first["input_ids"][:, 5:], torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(first["attention_mask"][:, 5:], torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(first["labels"][:, 5:], torch.full((2, 3), -100))
    assert len(loader) == 4 and len(list(loader)) == 4, "len() and a second epoch"
    uniform = ta.AsyncLoader([], "cpu", max_length=100, num_buckets=3)
    assert uniform.buckets == [33, 66, 99], "max_length // num_buckets * (i + 1)"


def test_longer_than_every_bucket_warns_once_and_gets_its_own_bucket():
    loader = ta.AsyncLoader([_batch(12), _batch(12), _batch(10), _batch(4)], "cpu", buckets=[4, 8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lengths = [b["input_ids"].shape[-1] for b in loader]
    assert lengths == [12, 12, 12, 4]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "length 12" in messages[0], messages


def test_bad_batches_are_named():
    batch = _batch(3)
    batch["position_ids"] = torch.arange(3).expand(2, 3)
    with pytest.raises(ValueError, match="'position_ids' has no pad value"):
        list(ta.AsyncLoader([batch], "cpu", buckets=[4]))
    with pytest.raises(ValueError, match="dict"):
        list(ta.AsyncLoader([torch.zeros(2, 3)], "cpu", buckets=[4]))
    pads = {"input_ids": 7, "attention_mask": 0, "labels": -1, "position_ids": 0}
    out = next(iter(ta.AsyncLoader([batch], "cpu", buckets=[4], pad_value_dict=pads)))
    assert out["input_ids"][:, 3].tolist() == [7, 7] and out["labels"][:, 3].tolist() == [-1, -1]


def test_debug_logs_each_batch_length(monkeypatch, capfd):
    monkeypatch.setenv("TORCHACC_DEBUG", "1")
    list(ta.AsyncLoader([_batch(5), _batch(9)], "cpu", buckets=[8, 16]))
    err = capfd.readouterr().err
    assert "batch length 5 -> bucket 8" in err and "batch length 9 -> bucket 16" in err


def test_batches_arrive_on_the_device_and_each_one_syncs():
    dev = ta.device()
    host = [_batch(n, seed=n) for n in (3, 6, 7)]
    loader = ta.AsyncLoader(host, dev, buckets=[4, 8])
    for epoch in range(2):
        metrics.clear_all()
        seen = []
        for batch in loader:
            assert batch["input_ids"].device.type == "torchacc"
            seen.append(batch["labels"].cpu())
            (batch["input_ids"] * 2).sum()  # pending work: the next batch syncs it
        assert [s.shape[-1] for s in seen] == [4, 8, 8]
        for s, h in zip(seen, host, strict=True):
            n = h["labels"].shape[-1]
            assert torch.equal(s[:, :n], h["labels"]) and (s[:, n:] == -100).all()
        assert metrics.counter_value("TransferToDevice") == 9, "three keys of three batches"
        assert metrics.counter_value("MarkStep") == 3, f"epoch {epoch}: one sync per batch"


class TinyLM(nn.Module):
    """A causal LM: causal attention and per-token layers, so right padding changes nothing at
    the real positions, and padded labels (-100) are ignored by the loss."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, labels):
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        x = x + self.mlp(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_bucketed_training_compiles_per_bucket_and_matches_eager():
    rng = random.Random(0)
    host = [_batch(rng.randint(2, 128), seed=i) for i in range(40)]
    torch.manual_seed(0)
    ref = TinyLM()
    model = TinyLM()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    expected = []
    for b in host:
        loss = ref(**b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.item())
    config = ta.Config()
    config.dataloader.buckets = [128, 32, 64]
    metrics.clear_all()
    model, loader = ta.accelerate(model, host, config)
    assert model.device == ta.device() and loader.buckets == [32, 64, 128]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in loader:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    losses = [t.item() for t in losses]
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    # one step program per bucket, plus the first step's (no gradients yet to accumulate into)
    print("programs", new_graphs())
    assert new_graphs() <= 3 + 1
