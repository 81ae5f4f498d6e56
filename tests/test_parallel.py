"""torchacc.parallel (MindSpore-style parallel modes) on 4 CPU devices, and its checkpoint slices
reloaded on 2 devices and on 1 (STAND_ALONE, for inference or further training).

The cases live in tests/spmd_cases/ and run in fresh processes: the device count
(``CPU_NUM_DEVICES``) must be set before JAX starts, and SPMD mode is for the whole process.
"""

import json
import os
import sys

import pytest
import torch
from spmd_launch import launch_gpt_tiny, run_cases, torchrun_case

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "spmd_cases"))


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_parallel")
def test_parallel_cases_on_4_devices_and_checkpoints_on_2_and_1(tmp_path, monkeypatch):
    monkeypatch.setenv("PARALLEL_CKPT_DIR", str(tmp_path))
    out = run_cases("case_parallel.py")
    assert " passed" in out and "failed" not in out
    out = run_cases("case_parallel_reload.py", devices=2)
    assert "1 passed" in out

    # one device, STAND_ALONE: the same slice files into a plain CPU model
    import ckpt_model

    import torchacc.parallel as par

    assert par.get_auto_parallel_context("parallel_mode") == par.ParallelMode.STAND_ALONE
    torch.manual_seed(2)
    model = ckpt_model.Wide()
    opt = ckpt_model.optimizer(model)
    files = [str(tmp_path / "slices" / f"device_{d}.ckpt") for d in range(4)]
    par.load_distributed_checkpoint(model, files, optimizer=opt)
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)["tensors"]
    for name, t in model.state_dict().items():
        assert torch.equal(t, full[name]), name
    expect = json.loads((tmp_path / "losses.json").read_text())
    losses = [ckpt_model.step(model, opt, i) for i in (3, 4)]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses, expect)), (losses, expect)


def test_sampler_shards_as_torch_and_global_batches_put_shard_d_on_device_d():
    from torchacc.parallel import DistributedSampler

    data = list(range(30))
    for shuffle in (True, False):
        shards = []
        for sid in range(4):
            ours = DistributedSampler(data, num_shards=4, shard_id=sid, shuffle=shuffle, seed=7)
            ours.set_epoch(3)
            ref = torch.utils.data.DistributedSampler(
                data, num_replicas=4, rank=sid, shuffle=shuffle, seed=7
            )
            ref.set_epoch(3)
            assert list(ours) == list(ref) and len(ours) == len(ref) == 8
            shards.append(list(ours))
        assert set().union(*shards) == set(data)  # every sample, padded to 4 x 8
    sampler = DistributedSampler(data, num_shards=4, shard_id=0, seed=1)
    batches = list(sampler.global_batches(8))
    assert len(batches) == 4
    for b, batch in enumerate(batches):
        for d in range(4):  # device d's quarter of the batch is shard d's next 2 samples
            assert batch[2 * d : 2 * d + 2] == sampler.shard(d)[2 * b : 2 * b + 2]
    with pytest.raises(ValueError, match=r"shard_id=4 must be in \[0, 4\)"):
        DistributedSampler(data, num_shards=4, shard_id=4)
    with pytest.raises(ValueError, match="batch_size=6 does not split into 4 shards"):
        next(sampler.global_batches(6))


@pytest.mark.slow
def test_launcher_semi_auto_with_a_strategy_file_matches_eager(tmp_path):
    """--compiler-opt --parallel_mode semi_auto --strategy_file on 4 CPU devices trains gpt-tiny
    with the eager single-process run's losses; bad flags are one-line errors (exit 2)."""
    strategy = "gallery/gpt/strategy_semi_auto.yaml"
    proc, semi = launch_gpt_tiny(
        tmp_path,
        "semi",
        "--compiler-opt",
        "--parallel_mode=semi_auto",
        f"--strategy_file={strategy}",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=4,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert f"parallel: {strategy} shards 8 layers" in log
    assert "parallel: mode semi_auto on 4 devices; parameter bytes per device" in log
    proc, eager = launch_gpt_tiny(tmp_path, "eager")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(semi["losses"]) == 4
    for a, b in zip(semi["losses"], eager["losses"]):
        assert abs(a - b) <= 1e-5, (semi["losses"], eager["losses"])
    for flags, message in (
        (("--parallel_mode=semi_auto",), "--parallel_mode runs one lazy process per node"),
        ((f"--strategy_file={strategy}",), "--strategy_file needs --parallel_mode semi_auto"),
        (
            ("--compiler-opt", "--parallel_mode=semi_auto", "--strategy_file=nope.yaml"),
            "--strategy_file nope.yaml: no such file",
        ),
        (("--compiler-opt", "--parallel_mode=semi", "--fsdp"), "invalid choice: 'semi'"),
    ):
        proc, _ = launch_gpt_tiny(tmp_path, "bad", *flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.devices(2)
def test_two_processes_broadcast_parameters_train_and_write_their_own_slices(tmp_path):
    """torchrun, 2 processes x 2 CPU devices: parameter_broadcast gives both ranks rank 0's
    weights, DATA_PARALLEL over the 4 devices sums the slice gradients as eager does, and each
    process writes the slice files of its own two devices (which merge into the model)."""

    out = tmp_path / "r"
    proc = torchrun_case("mp_parallel_worker.py", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"r.{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["rank"], r["size"]) for r in results] == [(0, 4), (2, 4)]
    assert [r["files"] for r in results] == [
        ["device_0.ckpt", "device_1.ckpt"],
        ["device_2.ckpt", "device_3.ckpt"],
    ]
    for r in results:
        assert r["broadcast_err"] == 0.0, r
        assert r["param_err"] <= 1e-5, r
        assert all(abs(a - b) <= 1e-5 for a, b in r["losses"]), r["losses"]
    import ckpt_model

    import torchacc.parallel as par

    merged = par.load_checkpoint(str(tmp_path / "r.slices"))
    assert set(merged) == set(ckpt_model.Wide().state_dict())
