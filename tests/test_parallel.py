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
from test_spmd import run_cases

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
