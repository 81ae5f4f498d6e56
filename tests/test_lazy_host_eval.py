"""Reads of values computed only from small uploads run on the host, not as a device program
(Note [Reads of host-known values] in torchacc/lazy/host_eval.py)."""

import pytest
import torch

import torchacc as ta
from torchacc import metrics
from torchacc.engine import transfer


def _executions():
    return (metrics.metric_data("ExecuteTime") or (0,))[0]


def _host_reads():
    return metrics.counter_value("HostEvaluatedRead") or 0


@pytest.fixture(autouse=True)
def _fresh_step():
    ta.sync()
    metrics.clear_all()


def test_a_mask_check_reads_on_the_host_and_the_step_stays_one_program():
    dev = ta.device()
    host_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    mask = host_mask.to(dev)
    x = torch.randn(2, 4).to(dev) * 2  # pending work of the step, which must not run yet
    b = mask.bool()
    all_set = bool(b.sum() == b.numel())  # transformers' fast_all
    tokens = (mask != 0).sum().item()
    prefix = b[:, :3].all().item()
    assert (all_set, tokens, prefix) == (False, 7, True)
    assert _host_reads() == 3 and _executions() == 0, "no program ran for the reads"
    host_mask[0, 3] = 1  # the host copy is the upload's, not the caller's tensor
    assert not bool(mask.bool().all()) and _executions() == 0
    ta.sync()  # x's step: one program
    assert _executions() == 1 and x.shape == (2, 4)


def test_reads_that_need_device_data_or_randomness_sync_as_before():
    dev = ta.device()
    big = torch.ones(transfer.MIRROR_MAX_ELEMENTS + 1).to(dev)  # too big to keep a host copy
    assert big.sum().item() == transfer.MIRROR_MAX_ELEMENTS + 1
    mask = torch.ones(4).to(dev)
    noisy = mask * torch.rand(4, device=dev)  # a random op: its value exists only on the device
    assert 0 <= noisy.sum().item() <= 4
    w = torch.ones(3).to(dev)
    w.mul_(3)
    ta.sync()  # w is now a computed result, no upload: reading from it runs a program
    assert (w * 2).sum().item() == 18
    assert _host_reads() == 0 and _executions() == 4  # 3 reads and the sync


def test_async_loader_batches_keep_their_host_copy():
    dev = ta.device()
    batches = [{"ids": torch.arange(6).view(2, 3), "mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}]
    for batch in ta.AsyncLoader(batches, dev):
        assert batch["mask"].device.type == dev.type
        assert (batch["mask"].sum(-1) == 3).tolist() == [False, True]
        assert batch["ids"].max().item() == 5
    assert _host_reads() == 2 and _executions() == 0


def test_hf_attention_mask_check_does_not_split_the_step():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    dev = ta.device()
    model.to(dev)
    ta.sync()
    metrics.clear_all()
    loss = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=ids.to(dev)).loss
    assert _host_reads() >= 1 and _executions() == 0, "the mask check ran no program"
    ta.sync()
    assert _executions() == 1
    torch.testing.assert_close(loss.cpu(), want, rtol=1e-5, atol=1e-6)
