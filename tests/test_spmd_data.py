"""Every process loads its own data (Note [Per-process batches] in torchacc/sharding/data.py):
a torchrun job of 2 processes x 2 CPU devices whose ranks feed their DistributedSampler shares
trains like eager PyTorch on the global batch, uploads only its share, and local batches that
disagree are an error on every rank, not a hang."""

from __future__ import annotations

import json

import pytest
from spmd_launch import launch_gpt_tiny, torchrun_case


@pytest.mark.slow
@pytest.mark.devices(2)
def test_each_process_feeds_its_share_of_the_global_batch(tmp_path):
    out = tmp_path / "r"
    proc = torchrun_case("mp_data_worker.py", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"r.{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        gpt = r["gpt"]
        # the global array is both ranks' batches: GPT-2 (tiny) FSDPv2 matches eager on them
        assert gpt["shapes"] == [[8, 16]] * 4, gpt["shapes"]
        assert max(abs(a - b) for a, b in zip(gpt["losses"], gpt["ref_losses"])) <= 1e-5, gpt
        assert gpt["param_err"] <= 1e-5, gpt["param_err"]
        assert gpt["graphs"][2:] == [0, 0], gpt["graphs"]  # no new program after step 2
        # each process uploads its share: half the global batch, to its own two devices
        assert gpt["sent_bytes"] == gpt["local_bytes"], gpt
        assert all(2 * s == g for s, g in zip(gpt["sent_bytes"], gpt["global_bytes"])), gpt

        # ta.accelerate dist.fsdp=2 (dp 2) with per-rank loaders: fsdp within a process (dp x
        # fsdp, the default topology) or across them (topology fsdp first)
        # (which processes hold fc1.weight's first fsdp shard: one per dp replica, or only the
        # fsdp group's first process)
        # (tp: fc1's output features split over each process's 2 devices, the batch over dp)
        cases = (
            ("accelerate", [0, 1]),
            ("accelerate_fsdp_outer", [0, 0]),
            ("accelerate_tp", [0, 1]),
        )
        for case, shard0 in cases:
            acc = r[case]
            assert max(abs(a - b) for a, b in zip(acc["losses"], acc["ref_losses"])) <= 1e-5, acc
            assert acc["param_err"] <= 1e-5, acc["param_err"]
            assert abs(acc["losses"][0] - acc["own_half"][0]) > 1e-3  # not this rank's half
            assert acc["processes_of_shard0"] == shard0, (case, acc["processes_of_shard0"])

        assert r["global_batch"] == [0.0, 0.0, 1.0, 1.0]  # sharding.data.global_batch
        shape = r["shape_error"]
        assert shape is not None and "process 0: batch[0]: float32[4, 16]" in shape, shape
        assert "process 1: batch[0]: float32[3, 16]" in shape, shape
        count = r["count_error"]
        assert count is not None and "process 0: the loader ended after 2 batches" in count
        assert "process 1: batch[0]: float32[4, 16]" in count, count
        split = r["split_error"]
        assert split is not None and "local shape (3, 16) (global (6, 16)" in split, split
        assert "make each process's batch size a multiple of its device count" in split, split
    assert results[0]["gpt"]["losses"] == results[1]["gpt"]["losses"]


@pytest.mark.slow
@pytest.mark.devices(2)
def test_horovod_averaging_mixes_with_fsdp_over_local_devices(tmp_path):
    """dp x fsdp in one step: each process's batch (its own, split over its 2 devices) through
    an FSDP-sharded model, hvd.DistributedOptimizer averaging across the 2 processes: equal to
    eager on the global batch, one program per step after step 2, half the bytes per process."""
    out = tmp_path / "m"
    proc = torchrun_case("mp_mix_data_worker.py", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"m.{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["shapes"] == [[4, 8]] * 4, r["shapes"]  # this process's own batch
        # per-process view: each rank's loss is its own half's, the update the global batch's
        assert max(abs(a - b) for a, b in zip(r["losses"], r["own_losses"])) <= 1e-5, r
        assert r["param_err"] <= 1e-5, r
        assert r["graphs"][2:] == [0, 0], r["graphs"]
        assert r["sent_bytes"] == r["local_bytes"], r
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert max(abs(a - b) for a, b in zip(mean, results[0]["ref_losses"])) <= 1e-5


def test_processes_per_machine_split_its_gpus_in_spmd_mode(monkeypatch):
    """--nproc_per_node N in SPMD mode: each process joins with its local rank's block of the
    machine's GPUs (not all of them); CPU processes keep their own devices."""
    import torch

    from torchacc.runtime import processes

    monkeypatch.setattr(processes, "wants_all_local_devices", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert processes._local_device_ids(0) == [0, 1, 2, 3]
    assert processes._local_device_ids(1) == [4, 5, 6, 7]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(RuntimeError, match="2 processes per machine .* over 3 GPUs"):
        processes._local_device_ids(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert processes._local_device_ids(1) is None  # CPU: every local device of this process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert processes._local_device_ids(0) is None  # one process per machine: all its GPUs
    monkeypatch.setattr(processes, "wants_all_local_devices", lambda: False)
    assert processes._local_device_ids(3) == [3]  # one device per process


@pytest.mark.slow
def test_launcher_fsdp_compiler_runs_n_processes_each_reading_its_share(tmp_path):
    """launch_single_task.py --compiler-opt --fsdp --nproc_per_node 2 (2 CPU devices each): each
    process reads its half of every batch (4 of 8 samples), uploads only that, and gpt-tiny
    trains with the losses of one eager process on the whole batch."""
    proc, sharded = launch_gpt_tiny(
        tmp_path,
        "fsdp2x2",
        "--compiler-opt",
        "--fsdp",
        "--nproc_per_node=2",
        "--batch_size=4",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "fsdp: mesh data=1 x fsdp=4" in log, log[-3000:]
    # gpt-tiny's batch: ids and targets of 4 x 64 int64 per process, half of the global 8 rows
    assert (
        "this process uploads 4,096 bytes per step, its share of the global batch (4,096 of "
        "8,192 bytes: 1/2)" in log
    ), log[-3000:]
    proc, eager = launch_gpt_tiny(tmp_path, "eager")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(sharded["losses"]) == 4
    for a, b in zip(sharded["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5, (sharded["losses"], eager["losses"])
