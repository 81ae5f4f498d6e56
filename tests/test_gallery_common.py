"""gallery/common: progress/peak-memory logging, atomic checkpoints, resumable sharded batches."""

from __future__ import annotations

import os

import pytest
import torch

from gallery.common import checkpoint, logger
from gallery.common.data import EpochBatches
from gallery.common.trainer import resolve_amp_dtype, step_seed


def test_switches_follow_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHACC_COMPILER_OPT", raising=False)
    assert not logger.enable_torchacc_compiler()
    monkeypatch.setenv("TORCHACC_COMPILER_OPT", "1")
    monkeypatch.setenv("TORCHACC_KERNEL_OPT", "0")
    assert logger.enable_torchacc_compiler() and not logger.enable_torchacc_kernel()


def test_log_metrics_line(capsys):
    log = logger.create_logger("test.gallery", rank=0)
    line = logger.log_metrics(
        0, 50, 128, torch.tensor(2.5), 0.1, 1280.0, 3.25,
        total_steps=200, eta=15.0, mem_source="cuda", logger=log,
    )  # fmt: skip
    assert line == (
        "epoch 0 step 50/200 ( 25%) | batch 128 | loss 2.5000 | 100.0 ms/step | "
        "1280.0 samples/s | peak mem 3.25 GiB (cuda) | ETA 0:00:15"
    )
    assert line in capsys.readouterr().out
    logger.log_params({"lr": 0.1}, log, world_size=2)
    out = capsys.readouterr().out
    assert "lr" in out and "world_size" in out
    assert logger.format_duration(3725) == "1:02:05" and logger.format_duration(None) == "?"


def test_peak_memory_hook():
    try:
        logger.reset_peak_memory_fn()
        gib, src = logger.peak_memory_gib()
        assert src == "host_rss" and gib > 0
        logger.set_peak_memory_fn(lambda: 3 * 2**30, "xla")
        assert logger.peak_memory_gib() == (3.0, "xla")

        def broken():
            raise RuntimeError("no memory info")

        logger.set_peak_memory_fn(broken, "xla")
        assert logger.peak_memory_gib()[1] == "host_rss"  # a broken hook falls back
    finally:
        logger.reset_peak_memory_fn()


def test_xla_memory_reader_accepts_both_key_styles():
    from gallery.common.trainer import _xla_peak_memory_fn

    class XM:
        def __init__(self, info):
            self.info = info

        def get_memory_info(self, device):
            return self.info

    assert _xla_peak_memory_fn(XM({"peak_bytes_used": 7, "bytes_used": 3}), None)() == 7
    assert _xla_peak_memory_fn(XM({"kb_total": 10, "kb_free": 4}), None)() == 6 * 1024


def test_checkpoints_are_atomic_and_rotated(tmp_path):
    d = str(tmp_path)
    for step in (2, 4, 6):
        state = {"step": step, "model": {"w": torch.ones(2) * step}, "optimizer": {}}
        checkpoint.save_checkpoint(d, state, step, keep=2)
    assert sorted(os.listdir(d)) == ["checkpoint_00000004.pt", "checkpoint_00000006.pt"]
    assert checkpoint.find_checkpoint(d).endswith("checkpoint_00000006.pt")
    assert checkpoint.load_checkpoint(d)["step"] == 6

    def crash(f):
        f.write(b"partial")
        raise OSError("disk full")

    target = os.path.join(d, "checkpoint_00000006.pt")
    with pytest.raises(OSError, match="disk full"):
        checkpoint.atomic_write_bytes(target, crash)
    assert checkpoint.load_checkpoint(target)["step"] == 6  # the old file is intact
    assert sorted(os.listdir(d)) == ["checkpoint_00000004.pt", "checkpoint_00000006.pt"]
    with pytest.raises(FileNotFoundError):
        checkpoint.find_checkpoint(str(tmp_path / "nothing"))


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n, batched):
        self.n = n
        if batched:
            self.get_batch = lambda idx: (idx.clone(), idx * 10)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i), torch.tensor(i * 10)


@pytest.mark.parametrize("batched", [True, False])
def test_epoch_batches_shard_and_resume(batched):
    ds = _Indexed(22, batched)
    ranks = [EpochBatches(ds, 3, r, 2, seed=7) for r in range(2)]
    assert ranks[0].steps_per_epoch == 3  # 11 samples per rank, 3 full batches
    seen = [torch.cat([x for x, _ in b.batches(epoch=1)]) for b in ranks]
    assert len(set(seen[0].tolist()) & set(seen[1].tolist())) == 0  # disjoint shards
    again = torch.cat([x for x, _ in ranks[0].batches(epoch=1)])
    assert torch.equal(seen[0], again)  # order depends on (seed, epoch) only
    other_epoch = torch.cat([x for x, _ in ranks[0].batches(epoch=2)])
    assert not torch.equal(seen[0], other_epoch)
    tail = torch.cat([x for x, _ in ranks[0].batches(epoch=1, start=1)])
    assert torch.equal(tail, seen[0][3:])  # resuming mid-epoch
    part = list(ranks[0].batches(epoch=1, start=1, stop=2))
    assert len(part) == 1 and torch.equal(part[0][0], seen[0][3:6])
    with pytest.raises(ValueError, match="too small"):
        EpochBatches(_Indexed(5, batched), 3, 0, 2, seed=0)


def test_amp_dtype_and_step_seed():
    from types import SimpleNamespace as NS

    assert resolve_amp_dtype(NS(amp_level="O0", amp_dtype="fp16"), cuda=False) is None
    assert resolve_amp_dtype(NS(amp_level="O1", amp_dtype=None), cuda=False) == torch.bfloat16
    assert resolve_amp_dtype(NS(amp_level="O1", amp_dtype="fp16"), cuda=False) == torch.float16
    seeds = {step_seed(42, r, s) for r in range(4) for s in range(100)}
    assert len(seeds) == 400
