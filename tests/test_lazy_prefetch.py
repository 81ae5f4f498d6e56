"""The lazy frontend's one prefetch loop (torchacc/lazy/prefetch.py), which torchacc.AsyncLoader
and torch_xla's ParallelLoader/MpDeviceLoader share: order, the end, errors, close."""

from __future__ import annotations

import time

import pytest
import torch

import torchacc
import torchacc.torch_xla.distributed.parallel_loader as pl
from torchacc.lazy.prefetch import END, Prefetcher


def _drain(p):
    out = []
    while (item := p.get()) is not END:
        out.append(item)
    return out


def test_batches_come_in_order_through_upload_and_wrap():
    seen = []
    p = Prefetcher(
        range(5),
        2,
        upload=lambda b: ("up", b),
        wrap=lambda u: (seen.append(u), u[1] * 10)[1],
        transform=lambda b: b + 1,
    )
    assert _drain(p) == [10, 20, 30, 40, 50]
    assert seen == [("up", i) for i in range(1, 6)]
    assert p.get() is END  # stays at the end


def test_an_error_in_the_host_loader_reaches_the_consumer():
    def source():
        yield 1
        raise RuntimeError("bad batch 2")

    p = Prefetcher(source(), 4, upload=lambda b: b, wrap=lambda b: b)
    assert p.get() == 1
    with pytest.raises(RuntimeError, match="bad batch 2"):
        p.get()
    assert p.get() is END


def test_close_stops_drawing_from_the_host_loader():
    drawn = []

    def source():
        for i in range(100):
            drawn.append(i)
            yield i

    p = Prefetcher(source(), 1, upload=lambda b: b, wrap=lambda b: b)
    assert p.get() == 0
    deadline = time.monotonic() + 10
    while len(drawn) < 3 and time.monotonic() < deadline:  # one queued, one in hand
        time.sleep(0.01)
    p.close()
    p.thread.join(timeout=5)
    assert not p.thread.is_alive() and len(drawn) == 3


def test_both_loaders_run_the_one_loop():
    dev = torchacc.device()
    batches = [torch.full((2,), float(i)) for i in range(3)]
    para = pl.ParallelLoader(batches, [dev])
    assert isinstance(para._prefetch, Prefetcher) and para._thread is para._prefetch.thread
    got = [b.cpu() for b in para.per_device_loader(dev)]
    epoch = iter(torchacc.AsyncLoader(batches, dev))
    assert isinstance(epoch._prefetch, Prefetcher)
    got_async = [b.cpu() for b in epoch]
    for a, b, c in zip(got, got_async, batches):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert len(got) == len(got_async) == 3


def test_check_sees_every_batch_then_the_end_and_can_stop_the_pass():
    seen = []

    def check(batch, done):
        seen.append(batch)
        return batch != 2

    p = Prefetcher(range(5), 4, upload=lambda b: b, wrap=lambda b: b, check=check)
    assert _drain(p) == [0, 1]  # False on batch 2: the pass stops there
    seen.clear()
    p = Prefetcher(range(3), 4, upload=lambda b: b, wrap=lambda b: b, check=check)
    assert _drain(p) == [0, 1] and seen == [0, 1, 2]
    p = Prefetcher([5, 6], 4, upload=lambda b: b, wrap=lambda b: b, check=check)
    assert _drain(p) == [5, 6]
    p.thread.join(timeout=5)
    assert seen[-3:] == [5, 6, None]  # and once more after the last batch
