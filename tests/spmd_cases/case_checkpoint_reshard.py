"""Loading the checkpoint case_checkpoint.py saved on 4 devices into other layouts (run by
tests/test_spmd_checkpoint.py after it, with CPU_NUM_DEVICES=2 and the same TORCHACC_CKPT_DIR):
another mesh of 2 devices with other splits, replicated tensors, and plain CPU tensors."""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ckpt_models import assert_equal, build, mesh, prime, spec_of, specs, state, step  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.torch_xla.experimental.distributed_checkpoint import (  # noqa: E402
    CheckpointManager,
    SafeFileSystemReader,
    SPMDLoadPlanner,
    prime_optimizer,
)

xr.use_spmd()
DEV = torchacc.device()
CKPT = os.environ["TORCHACC_CKPT_DIR"]


def _reference(step_):
    return torch.load(os.path.join(CKPT, f"reference-{step_}.pt"), weights_only=True)


def test_restore_into_a_two_device_mesh_reshards():
    assert xr.global_runtime_device_count() == 2
    tp_mesh = mesh([0, 1], (1, 2), ("data", "model"))
    fsdp_mesh = mesh([0, 1], (2, 1), ("fsdp", "model"))
    # saved: tp.0.weight split on its rows over 2 of 4 devices; now on its columns over 2
    tp, fsdp, opts = build(DEV, tp_mesh, fsdp_mesh, seed=5, tp_dim0=None)
    prime(opts, prime_optimizer)
    sd = state(tp, fsdp, opts)
    layout = specs(sd)
    mgr = CheckpointManager(os.path.join(CKPT, "mgr"), save_interval=10)
    assert mgr.all_steps() == [20, 30]
    mgr.restore(30, sd)
    assert_equal(sd, _reference(30))
    assert specs(sd) == layout
    assert spec_of(tp[0].weight) == {0: ((0, 32), (0, 8)), 1: ((0, 32), (8, 16))}
    assert spec_of(fsdp._orig_module[0].weight) == {0: ((0, 16), (0, 16)), 1: ((16, 32), (0, 16))}
    step(tp, fsdp, opts, DEV, seed=4)  # and training goes on from there
    assert torch.isfinite(tp[0].weight.detach().cpu()).all()


def test_restore_into_replicated_and_cpu_tensors():
    ref = _reference(20)
    targets = {}
    for i, (k, v) in enumerate(sorted(ref.items())):
        targets[k] = torch.full_like(v, 7.0) if i % 2 else torch.full_like(v, 7.0).to(DEV)
    dcp.load(
        targets,
        storage_reader=SafeFileSystemReader(os.path.join(CKPT, "mgr", "20")),
        planner=SPMDLoadPlanner(),
    )
    assert_equal(targets, ref)
    on_device = [v for v in targets.values() if v.device.type == "torchacc"]
    assert len(on_device) >= len(ref) // 2
    for v in on_device:  # replicated: every device holds the whole tensor
        full = tuple((0, n) for n in v.shape)
        assert set(spec_of(v).values()) == {full}
