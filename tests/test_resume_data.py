"""Checkpointable data and safe restores (issue 42 parts 1-2): samplers, ``ta.AsyncLoader``
(bucketing included), the gallery's ``EpochBatches`` and packed dataset save their position as a
global sample count (Note [Data positions]); a resumed run takes exactly the samples the
uninterrupted one takes, on the same and on other data-parallel sizes; ``CheckpointManager``
saves and restores the loader with the model, and refuses bad checkpoints (another model, another
dataset, some ranks' files, a newer format) with the directory named and nothing changed."""

import json
import logging
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import torchacc as ta
from gallery.common.data import EpochBatches
from gallery.gpt.data import PackedMockTokens
from torchacc.distributed.checkpoint import prime_optimizer
from torchacc.distributed.checkpoint_manager import CheckpointError, CheckpointManager, RNGState
from torchacc.distributed.data_state import DataStateError, StatefulDistributedSampler
from torchacc.parallel.sampler import DistributedSampler as ParallelSampler

DEV = ta.device()
DATA = TensorDataset(torch.arange(60))


def _replica_batches(n_replicas, batch, loaders, stop=None):
    """Global batches (sorted sample ids) over a pass of ``loaders`` (one per replica)."""
    seen = []
    for k, batches in enumerate(zip(*loaders)):
        seen.append(sorted(int(x) for b in batches for x in b[0].reshape(-1).cpu()))
        if stop is not None and k + 1 == stop:
            break
    return seen


def _stateful_loaders(world, batch, drop_last, device=DEV, state=None, seed=3):
    out = []
    for r in range(world):
        sampler = StatefulDistributedSampler(
            DATA, num_replicas=world, rank=r, seed=seed, drop_last=drop_last
        )
        loader = ta.AsyncLoader(DataLoader(DATA, batch_size=batch, sampler=sampler), device)
        if state is not None:
            loader.load_state_dict(state)
        out.append(loader)
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_async_loader_resumes_with_the_same_samples_on_1_2_and_4_replicas(drop_last):
    """Saved on 2 replicas x batch 6 after 2 of 5 global batches of 12; resumed on 2 x 6,
    4 x 3 and 1 x 12: the same global batches as the uninterrupted 2-replica run, none twice.
    The state is the consumer's position, not the prefetcher's (4 batches ahead here)."""
    full = _replica_batches(2, 6, _stateful_loaders(2, 6, drop_last))
    assert len(full) == 5 and len({i for b in full for i in b}) == 60
    first = _stateful_loaders(2, 6, drop_last)
    its = [iter(x) for x in first]
    head = _replica_batches(2, 6, its, stop=2)
    state = first[0].state_dict()
    assert state["batches"] == 2 and state["host"]["consumed"] == 24, state
    for world in (2, 4, 1):
        rest = _replica_batches(
            world, 12 // world, _stateful_loaders(world, 12 // world, False, state=state)
        )
        assert head + rest == full, (world, head, rest)


def test_async_loader_state_keeps_buckets_and_fast_forwards_a_stateless_host():
    """A host loader without state (a list) is fast-forwarded; a bucket grown by a long batch
    is in the state, so the resumed loader pads the same way."""
    lengths = [5, 20, 7, 3, 9]
    batches = [
        {"input_ids": torch.full((2, n), i), "labels": torch.zeros(2, n)}
        for i, n in enumerate(lengths)
    ]
    pads = {"input_ids": 0, "labels": -100}
    with pytest.warns(UserWarning, match="longer than every bucket"):
        loader = ta.AsyncLoader(batches, "cpu", buckets=[8, 16], pad_value_dict=pads)
        it = iter(loader)
        next(it), next(it), next(it)
    state = loader.state_dict()
    assert state["batches"] == 3 and state["host"] is None and state["buckets"] == [8, 16, 20]
    resumed = ta.AsyncLoader(batches, "cpu", buckets=[8, 16], pad_value_dict=pads)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [int(b["input_ids"][0, 0]) for b in rest] == [3, 4]
    assert [b["input_ids"].shape[-1] for b in rest] == [8, 16]
    assert resumed.buckets == [8, 16, 20]
    assert len(list(resumed)) == 5, "the next pass is a whole one"
    with pytest.raises(DataStateError, match="buckets"):
        ta.AsyncLoader(batches, "cpu").load_state_dict(state)


def test_parallel_sampler_and_epoch_batches_resplit_the_global_order():
    """torchacc.parallel's sampler (one process feeding every shard) and the launcher's
    EpochBatches: a position saved on 2 shards continues on 1, 2 and 4 with the batches an
    uninterrupted run takes."""
    ref = ParallelSampler(DATA, num_shards=2, shard_id=0, seed=5)
    ref.set_epoch(1)
    full = [sorted(b) for b in ref.global_batches(8)]
    part = ParallelSampler(DATA, num_shards=2, shard_id=0, seed=5)
    part.set_epoch(1)
    it = part.global_batches(8)
    head = [sorted(next(it)) for _ in range(3)]
    state = part.state_dict()
    assert state["consumed"] == 24 and state["epoch"] == 1
    for shards in (1, 2, 4):
        s = ParallelSampler(DATA, num_shards=shards, shard_id=0, seed=5)
        s.load_state_dict(state)
        assert head + [sorted(b) for b in s.global_batches(8)] == full, shards
    with pytest.raises(DataStateError, match="dataset_len is 60, this DistributedSampler's is 50"):
        ParallelSampler(TensorDataset(torch.arange(50)), 2, 0, seed=5).load_state_dict(state)

    def run(world, start=0, epoch=0):
        parts = [
            EpochBatches(DATA, 12 // world, r, world, seed=9, shuffle=True) for r in range(world)
        ]
        out = []
        for batches in zip(*(p.batches(epoch, start) for p in parts)):
            out.append(sorted(int(i) for b in batches for i in b[0]))
        return out, parts[0]

    full, eb = run(2)
    saved = eb.state_dict(0, 2)
    for world in (1, 2, 3, 4):
        _, other = run(world)
        epoch, step = other.load_state_dict(saved)
        assert run(world, step, epoch)[0] == full[2:], world
    with pytest.raises(
        DataStateError, match="not a whole number of this run's global batches of 10"
    ):
        EpochBatches(DATA, 5, 0, 2, seed=9).load_state_dict(saved)
    with pytest.raises(DataStateError, match="seed is 9, this EpochBatches's is 1"):
        EpochBatches(DATA, 6, 0, 2, seed=1).load_state_dict(saved)


def test_packed_dataset_state_names_another_dataset():
    ds = PackedMockTokens(64, 16, num_samples=32, seed=1, corpus_tokens=4096)
    eb = EpochBatches(ds, 4, 0, 1, seed=0)
    state = eb.state_dict(0, 3)
    assert state["dataset"]["kind"] == "PackedMockTokens"
    assert eb.load_state_dict(state, source="ck/3") == (0, 3)
    other = PackedMockTokens(64, 16, num_samples=32, seed=2, corpus_tokens=4096)
    with pytest.raises(
        DataStateError, match=r"ck/3: PackedMockTokens state is for another dataset: its seed is 1"
    ):
        EpochBatches(other, 4, 0, 1, seed=0).load_state_dict(state, source="ck/3")
    shorter = PackedMockTokens(64, 16, max_len=8, num_samples=32, seed=1, corpus_tokens=4096)
    with pytest.raises(DataStateError, match="max_len is 16, this PackedMockTokens's is 8"):
        shorter.load_state_dict(state["dataset"])


# --- CheckpointManager: the loader with the model --------------------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(DEV)


def _features(ids):
    ids = ids.to(torch.float32)
    return torch.stack([ids, ids.sin(), ids.cos(), (ids / 7).frac()], 1) / 60


def _train(model, opt, loader, steps, mgr=None, start=0):
    """Loss and sample ids per step; saves model, optimizer and loader every 2 steps."""
    losses, seen = [], []
    it = iter(loader)
    for step in range(start + 1, start + steps + 1):
        (ids,) = next(it)
        x = _features(ids.cpu()).to(DEV)
        loss = (model(x).squeeze(1) - x[:, 0]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ta.sync()
        losses.append(loss.item())
        seen.append(sorted(ids.cpu().tolist()))
        if mgr is not None:
            mgr.save(step, _state(model, opt, loader))
    return losses, seen


def _state(model, opt, loader):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "loader": loader}


def _setup(seed=0, data_seed=3, data=DATA):
    model = _model(seed)
    opt = prime_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    sampler = StatefulDistributedSampler(data, num_replicas=1, rank=0, seed=data_seed)
    loader = ta.AsyncLoader(DataLoader(data, batch_size=6, sampler=sampler), DEV)
    return model, opt, loader


def _snapshot(model, opt, loader):
    return (
        {k: v.cpu().clone() for k, v in model.state_dict().items()},
        json.dumps(loader.state_dict(), sort_keys=True),
    )


def _unchanged(before, after):
    return all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1] == after[1]


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """6 steps uninterrupted, saving every 2."""
    path = str(tmp_path_factory.mktemp("ck"))
    mgr = CheckpointManager(path, save_interval=2, num_of_threads=2)
    model, opt, loader = _setup()
    losses, seen = _train(model, opt, loader, 6, mgr)
    return path, losses, seen


def test_checkpoint_manager_resumes_model_optimizer_and_loader(run4):
    """Restoring step 2 into a fresh model, optimizer and loader: the next 4 steps take the
    uninterrupted run's samples and give its losses, bit for bit."""
    path, losses, seen = run4
    mgr = CheckpointManager(path, save_interval=2)
    assert mgr.all_steps() == [2, 4, 6] and mgr.latest_step() == 6
    model, opt, loader = _setup(seed=7)  # its optimizer is primed: state to load into
    state = _state(model, opt, loader)
    mgr.restore(2, state)
    opt.load_state_dict(state["optim"])
    assert loader.state_dict()["host"]["consumed"] == 12
    got_losses, got_seen = _train(model, opt, loader, 4, start=2)
    assert got_seen == seen[2:6]
    assert got_losses == losses[2:6]


def test_restore_refuses_another_model_with_the_directory_named_and_nothing_changed(run4):
    path, _, _ = run4
    mgr = CheckpointManager(path, save_interval=2)
    step4 = os.path.join(path, "4")
    # other shapes
    model, opt, loader = _setup(seed=7)
    model[0] = nn.Linear(4, 16).to(DEV)
    model[2] = nn.Linear(16, 1).to(DEV)
    opt = prime_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before = _snapshot(model, opt, loader)
    with pytest.raises(
        CheckpointError, match=rf"{step4}: .*'model\.0\.weight' of shape \(16, 4\).*\(8, 4\)"
    ):
        mgr.restore(4, _state(model, opt, loader))
    assert _unchanged(before, _snapshot(model, opt, loader))
    # other keys
    model, opt, loader = _setup(seed=7)
    model.append(nn.Linear(1, 1).to(DEV))
    opt = prime_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before = _snapshot(model, opt, loader)
    with pytest.raises(
        CheckpointError,
        match=rf"{step4}: 'model' is not what the checkpoint holds: 2 keys missing in the "
        r"checkpoint \(e\.g\. 'model\.3\.bias'\)",
    ):
        mgr.restore(4, _state(model, opt, loader))
    assert _unchanged(before, _snapshot(model, opt, loader))


def test_restore_refuses_a_loader_of_another_dataset_and_changes_nothing(run4):
    path, _, _ = run4
    mgr = CheckpointManager(path, save_interval=2)
    for data, data_seed, what in [
        (
            TensorDataset(torch.arange(48)),
            3,
            "dataset_len is 60, this StatefulDistributedSampler's is 48",
        ),
        (DATA, 4, "seed is 3, this StatefulDistributedSampler's is 4"),
    ]:
        model, opt, loader = _setup(seed=7, data_seed=data_seed, data=data)
        before = _snapshot(model, opt, loader)
        with pytest.raises(DataStateError, match=f"{os.path.join(path, '4')}: .*{what}"):
            mgr.restore(4, _state(model, opt, loader))
        assert _unchanged(before, _snapshot(model, opt, loader))


def test_restore_refuses_some_ranks_files_and_a_newer_format(run4, tmp_path):
    import shutil

    path, _, _ = run4
    base = tmp_path / "copy"
    shutil.copytree(path, base)
    files = sorted(f for f in os.listdir(base / "4") if f.endswith(".distcp"))
    assert len(files) == 2, files  # two writer threads: two data files
    os.unlink(base / "4" / files[1])
    meta = json.loads((base / "2" / ".manager_metadata").read_text())
    (base / "2" / ".manager_metadata").write_text(json.dumps({**meta, "format": 99}))
    mgr = CheckpointManager(str(base), save_interval=2)
    model, opt, loader = _setup(seed=7)
    before = _snapshot(model, opt, loader)
    with pytest.raises(
        CheckpointError,
        match=rf"{base / '4'}: incomplete checkpoint: missing 1 of 2 data files \({files[1]}\)",
    ):
        mgr.restore(4, _state(model, opt, loader))
    with pytest.raises(
        CheckpointError,
        match=rf"{base / '2'}: checkpoint format version 99 was written by a newer torchacc",
    ):
        mgr.restore(2, _state(model, opt, loader))
    assert _unchanged(before, _snapshot(model, opt, loader))


def test_incomplete_saves_are_named_and_the_newest_complete_one_is_used(run4, tmp_path, caplog):
    import shutil

    path, _, _ = run4
    base = tmp_path / "copy"
    shutil.copytree(path, base)
    shutil.copytree(base / "4", base / ".tmp-8")
    os.unlink(base / ".tmp-8" / ".manager_metadata")
    with caplog.at_level(logging.WARNING):
        mgr = CheckpointManager(str(base), save_interval=2)
    assert mgr.latest_step() == 6 and mgr.incomplete == [".tmp-8"]
    assert "skipping incomplete checkpoints" in caplog.text and ".tmp-8" in caplog.text


def test_rng_state_resumes_the_dropout_streams(tmp_path):
    """Dropout on the torchacc device: restoring the checkpoint with ``RNGState`` continues the
    saved run's random streams (the same losses, bit for bit); without it they differ."""

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.5), nn.Linear(32, 1)).to(DEV)
        opt = prime_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        return model, opt

    x = _features(torch.arange(8)).to(DEV)

    def steps(model, opt, n, mgr=None, rng=None):
        out = []
        for step in range(1, n + 1):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ta.sync()
            out.append(loss.item())
            if mgr is not None and step == 2:
                mgr.save(2, {"model": model.state_dict(), "rng": rng})
        return out

    mgr = CheckpointManager(str(tmp_path), save_interval=2)
    ref = steps(*setup(), 4, mgr, RNGState())
    for with_rng in (True, False):
        model, opt = setup()
        torch.manual_seed(123)  # another stream, as a new process would have
        state = {"model": model.state_dict()}
        if with_rng:
            state["rng"] = RNGState()
        mgr.restore(2, state)
        got = steps(model, opt, 2)
        assert (got == ref[2:]) == with_rng, (with_rng, got, ref[2:])


def test_launcher_checkpoint_of_a_newer_format_is_refused_by_name(tmp_path):
    from gallery.common.checkpoint import (
        FORMAT_VERSION,
        NewerCheckpointError,
        load_checkpoint,
        resolve_checkpoint,
        save_checkpoint,
    )

    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "step": 3}
    old = save_checkpoint(str(tmp_path), state, 3)
    assert load_checkpoint(old)["format_version"] == FORMAT_VERSION
    newer = save_checkpoint(str(tmp_path), {**state, "step": 4}, 4)
    torch.save({**state, "step": 4, "format_version": FORMAT_VERSION + 1}, newer)
    pattern = rf"{newer}: checkpoint format version {FORMAT_VERSION + 1} was written by a newer"
    with pytest.raises(NewerCheckpointError, match=pattern):
        load_checkpoint(newer)
    with pytest.raises(NewerCheckpointError, match=pattern):  # not skipped as if damaged
        resolve_checkpoint(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_saves_the_data_position_and_refuses_another_dataset(tmp_path):
    """The launcher's one-file checkpoint holds EpochBatches' position; resuming it names the
    position it continues from, and on another dataset (--mock_samples) exits 2 naming the file
    and the field."""
    from gallery_harness import run_module

    from gallery.common.checkpoint import load_checkpoint

    common = ["--model=gpt-tiny", "--seq_len=16", "--batch_size=2", "--amp_level=O0"]
    ck = tmp_path / "ckpt"
    run_module("gallery.gpt.main", *common, "--mock_samples=8", "--max_steps=3", f"--save_dir={ck}")
    (path,) = ck.iterdir()
    data = load_checkpoint(str(path))["data"]
    assert (data["kind"], data["epoch"], data["consumed"], data["dataset_len"]) == (
        "EpochBatches",
        0,
        6,
        8,
    )
    p = run_module(
        "gallery.gpt.main",
        *common,
        "--mock_samples=10",
        "--max_steps=4",
        f"--resume={ck}",
        expect_rc=2,
    )
    out = p.stdout + p.stderr
    assert f"error: --resume {path}: EpochBatches state is for another dataset: its " in out
    assert "dataset_len is 8, this EpochBatches's is 10" in out
