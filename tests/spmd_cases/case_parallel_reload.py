"""Slice files saved on 4 devices, loaded on 2 (run by tests/test_parallel.py with
CPU_NUM_DEVICES=2 and PARALLEL_CKPT_DIR holding case_parallel.py's checkpoints)."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import ckpt_model  # noqa: E402

import torchacc  # noqa: E402
import torchacc.parallel as par  # noqa: E402
from torchacc.distributed import sharding as engine  # noqa: E402

par.init()
DEV = torchacc.device()
OUT = os.environ["PARALLEL_CKPT_DIR"]


def test_slices_of_4_devices_reload_on_2_and_training_continues():
    assert par.get_group_size() == 2
    par.set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradients_mean=True)
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them all
    model = ckpt_model.Wide()
    ckpt_model.plan(model, par)
    model = par.parallelize(model.to(DEV))
    opt = ckpt_model.optimizer(model)
    files = [os.path.join(OUT, "slices", f"device_{d}.ckpt") for d in range(4)]
    missing = r"device\(s\) \[2, 3\] \(of 4 saved\) are not in ckpt_files; missing slices: \['f"
    with pytest.raises(ValueError, match=missing):
        par.load_distributed_checkpoint(model, files[:2], optimizer=opt)
    par.load_distributed_checkpoint(model, files, optimizer=opt)
    full = torch.load(os.path.join(OUT, "full.ckpt"), weights_only=True)["tensors"]
    for name, t in model.state_dict().items():
        assert torch.equal(t.cpu(), full[name]), name  # bit-identical
    # re-sliced for 2 devices: the model's layout (fc1 rows over both devices) was kept
    assert [tuple(s[0].shape) for s in engine.local_shards(model.fc1.weight)] == [(128, 64)] * 2
    state = opt.state[model.fc1.weight]["exp_avg"]
    assert engine.sharding_of(state) == engine.sharding_of(model.fc1.weight)
    with open(os.path.join(OUT, "losses.json")) as f:
        expect = json.load(f)
    losses = [ckpt_model.step(model, opt, i, DEV, torchacc.sync) for i in (3, 4)]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses, expect)), (losses, expect)
    # predict_strategy: a model with no plan of its own takes the layout it names
    other = ckpt_model.Wide().to(DEV)
    par.load_distributed_checkpoint(other, files, predict_strategy={"fc1.weight": (1, 2)})
    assert [tuple(s[0].shape) for s in engine.local_shards(other.fc1.weight)] == [(256, 32)] * 2
    for name, t in other.state_dict().items():
        assert torch.equal(t.cpu(), full[name]), name
    with pytest.raises(ValueError, match=r"predict_strategy\['fc2.weight'\]: strategy \(3, 1\)"):
        par.load_distributed_checkpoint(other, files, predict_strategy={"fc2.weight": (3, 1)})
