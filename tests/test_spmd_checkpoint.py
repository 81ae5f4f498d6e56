"""Distributed checkpoints (torch.distributed.checkpoint with torch_xla's SPMD planners and
CheckpointManager) of sharded training state, saved on 4 CPU devices and loaded into other
layouts.

The cases live in tests/spmd_cases/ and run in fresh processes (the device count must be set
before JAX starts): case_checkpoint.py saves on a 2x2 data x model mesh and checks the
checkpoint, same-mesh restores, bad shapes, crashes mid-save, async saves and weights_only
reads; case_checkpoint_reshard.py loads that checkpoint on 2 devices (another mesh, replicated,
CPU tensors); the test's own process loads it on 1 device without SPMD. A 2-process x 2-device
job (mp_checkpoint_worker.py) checks that each process writes only its own shards.
"""

import copy
import os
import sys

import pytest
from spmd_launch import run_cases, torchrun_case

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.xdist_group("spmd_checkpoint")
def test_checkpoint_saved_on_4_devices_restores_on_4_2_and_1(tmp_path):
    run_cases("case_checkpoint.py", 4, {"TORCHACC_CKPT_DIR": tmp_path})
    run_cases("case_checkpoint_reshard.py", 2, {"TORCHACC_CKPT_DIR": tmp_path})
    _restore_on_one_device_without_spmd(tmp_path)


def _restore_on_one_device_without_spmd(ckpt):
    """This process (one device, no SPMD): the tensor-parallel model and its optimizer state
    for evaluation, from a part of the checkpoint."""
    import torch

    import torchacc
    from torchacc.distributed import sharding
    from torchacc.torch_xla.experimental.distributed_checkpoint import CheckpointManager

    assert not sharding.is_spmd()
    dev = torchacc.device()
    ref = torch.load(os.path.join(ckpt, "reference-30.pt"), weights_only=True)
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    cpu = copy.deepcopy(model)
    model.to(dev)
    state = {k: torch.zeros_like(v).to(dev) for k, v in ref.items() if k.startswith("opt_tp.")}
    state["tp"] = model.state_dict()
    mgr = CheckpointManager(os.path.join(ckpt, "mgr"), save_interval=10)
    mgr.restore(30, state)  # the other keys of the checkpoint are not read
    for k, v in state.items():
        if k != "tp":
            assert torch.equal(v.cpu(), ref[k]), k
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), ref[f"tp.{name}"]), name
    cpu.load_state_dict({k[3:]: v for k, v in ref.items() if k.startswith("tp.")})
    x = torch.randn(4, 16)
    assert torch.allclose(model(x.to(dev)).cpu(), cpu(x), atol=1e-6)


@pytest.mark.slow
@pytest.mark.devices(2)
def test_two_processes_write_only_their_own_shards(tmp_path):
    """torchrun, 2 processes x 2 CPU devices, one 2x2 mesh (rows = processes): each process
    writes the blocks whose replica 0 it holds, into its own file; together they are every
    block once (a weight split on 'model' and replicated on 'data' included); restoring into
    the same and into other layouts is bit-identical on both processes."""
    import json

    sys.path.insert(0, os.path.join(HERE, "spmd_cases"))
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchacc.distributed.checkpoint import SafeFileSystemReader

    out, ckpt = tmp_path / "r", tmp_path / "ckpt"
    proc = torchrun_case("mp_checkpoint_worker.py", out, ckpt)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"r.{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["same_layout_mismatches"] == [] and r["other_layout_mismatches"] == []
        assert r["steps"] == [1]
    assert sorted(os.listdir(ckpt)) == ["1"]
    md = SafeFileSystemReader(str(ckpt / "1")).read_metadata()
    for fqn, written0 in results[0]["written"].items():
        written1 = results[1]["written"][fqn]
        blocks = {tuple(o) for o in written0} | {tuple(o) for o in written1}
        assert not {tuple(o) for o in written0} & {tuple(o) for o in written1}, fqn
        chunks = md.state_dict_metadata[fqn]
        assert isinstance(chunks, TensorStorageMetadata)
        assert blocks == {tuple(c.offsets) for c in chunks.chunks}, fqn
        for index, info in md.storage_data.items():
            if index.fqn == fqn:
                owner = 0 if list(index.offset) in written0 else 1
                assert info.relative_path.startswith(f"__{owner}_"), (fqn, index, info)
    # split on 'model', replicated on 'data' (= over the processes): both halves, written by
    # the process holding replica 0; split on 'fsdp' over 4 devices: 2 blocks per process
    assert results[0]["written"]["tp.0.weight"] == [[0, 0], [16, 0]]
    assert results[1]["written"]["tp.0.weight"] == []
    assert results[0]["written"]["fsdp._orig_module.0.weight"] == [[0, 0], [8, 0]]
    assert results[1]["written"]["fsdp._orig_module.0.weight"] == [[16, 0], [24, 0]]
