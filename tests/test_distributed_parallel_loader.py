"""MpDeviceLoader / ParallelLoader: background upload, one mark_step per batch, errors surface."""

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import torchacc
from torchacc import metrics
from torchacc.torch_xla.distributed import parallel_loader as pl


def _marks():
    return metrics.counter_value("MarkStep") or 0


def test_batches_arrive_on_the_device_with_a_sync_each():
    xs, ys = torch.randn(10, 3), torch.arange(10)
    loader = DataLoader(TensorDataset(xs, ys), batch_size=4)
    device_loader = pl.MpDeviceLoader(loader, torchacc.device())
    assert len(device_loader) == 3
    before = _marks()
    got = []
    for x, y in device_loader:
        assert x.device.type == "torchacc" and y.device.type == "torchacc"
        got.append((x * 2, y))  # recorded; computed by the loader's next mark_step
    assert _marks() - before == len(loader) + 2  # as torch_xla: per batch taken, and at the end
    torch.testing.assert_close(torch.cat([x.cpu() for x, _ in got]), xs * 2)
    assert torch.cat([y.cpu() for _, y in got]).tolist() == list(range(10))


def test_nested_batches_and_batches_per_execution():
    items = [
        {"a": torch.full((2,), float(i)), "meta": ("id", i), "b": [torch.tensor(i)]}
        for i in range(6)
    ]
    para = pl.ParallelLoader(
        items, [torchacc.device()], batches_per_execution=2, device_prefetch_size=2
    )
    before = _marks()
    seen = list(para.per_device_loader(torchacc.device()))
    assert _marks() - before == 6 // 2 + 1  # every 2nd batch taken, and at the end
    for i, batch in enumerate(seen):
        assert batch["meta"] == ("id", i)
        assert batch["a"].device.type == "torchacc"
        assert batch["a"].cpu().tolist() == [float(i)] * 2
        assert batch["b"][0].item() == i


class _Broken(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise ValueError("bad sample 2")
        return torch.ones(2)


def test_loader_errors_surface_in_the_training_loop():
    device_loader = pl.MpDeviceLoader(DataLoader(_Broken(), batch_size=1), torchacc.device())
    it = iter(device_loader)
    next(it)
    next(it)
    with pytest.raises(ValueError, match="bad sample 2"):
        next(it)


def test_close_stops_the_worker():
    drawn = []

    def source():  # counts what the worker draws from the user's loader
        for i in range(100):
            drawn.append(i)
            yield torch.ones(1)

    para = pl.ParallelLoader(source(), [torchacc.device()], device_prefetch_size=1)
    it = para.per_device_loader(torchacc.device())
    next(it)
    deadline = time.monotonic() + 10
    while len(drawn) < 3 and time.monotonic() < deadline:  # one taken, one queued, one in hand
        time.sleep(0.01)
    time.sleep(0.3)  # the worker waits on the full queue with its batch in hand
    assert len(drawn) == 3
    para.close()
    para._thread.join(timeout=5)
    assert not para._thread.is_alive()
    assert len(drawn) == 3  # a closed loader draws nothing more from the source
    with pytest.raises(ValueError, match="torchacc device"):
        pl.ParallelLoader([], [torch.device("cpu")])
    with pytest.raises(ValueError, match="batches_per_execution must be >= 1"):
        pl.ParallelLoader([], [torchacc.device()], batches_per_execution=0)
