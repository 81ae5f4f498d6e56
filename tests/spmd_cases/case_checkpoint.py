"""Distributed checkpoints on 4 CPU devices (run by tests/test_spmd_checkpoint.py with
CPU_NUM_DEVICES=4 and TORCHACC_CKPT_DIR, which the 2-device stage then loads from).

A tensor-parallel MLP on a 2x2 data x model mesh (weights split on 'model', replicated on
'data') and an FSDPv2 MLP on 4 devices, with AdamW state, saved through DCP: every tensor is in
the checkpoint once, the same mesh restores it bit for bit, bad shapes change nothing, a crash
mid-save keeps the previous checkpoint, async saves snapshot the state, reads are weights_only.
"""

import os
import pickle
import shutil
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ckpt_models import (  # noqa: E402
    assert_equal,
    build,
    host_copy,
    mesh,
    prime,
    spec_of,
    specs,
    state,
    step,
)

import torchacc  # noqa: E402
import torchacc.alias  # noqa: E402, F401
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.lazy.record import value_of  # noqa: E402

xr.use_spmd()
DEV = torchacc.device()
CKPT = os.environ["TORCHACC_CKPT_DIR"]
TP_MESH = mesh(range(4), (2, 2), ("data", "model"))
FSDP_MESH = mesh(range(4), (4, 1), ("fsdp", "model"))

# the torch_xla front door, as a torch_xla script imports it
from torch_xla.experimental.distributed_checkpoint import (  # noqa: E402
    CheckpointManager,
    SafeFileSystemReader,
    SPMDLoadPlanner,
    SPMDSavePlanner,
    prime_optimizer,
)


def _fresh(seed):
    tp, fsdp, opt = build(DEV, TP_MESH, FSDP_MESH, seed=seed)
    prime(opt, prime_optimizer)
    return tp, fsdp, opt


@pytest.fixture(scope="module")
def saved():
    tp, fsdp, opt = build(DEV, TP_MESH, FSDP_MESH, seed=0)
    step(tp, fsdp, opt, DEV, seed=1)
    sd = state(tp, fsdp, opt)
    ref = host_copy(sd)
    mgr = CheckpointManager(os.path.join(CKPT, "mgr"), save_interval=10, max_to_keep=2)
    assert not mgr.save(5, sd)  # not a checkpoint step
    assert mgr.save(10, sd)
    torch.save(ref, os.path.join(CKPT, "reference-10.pt"))
    return SimpleNamespace(tp=tp, fsdp=fsdp, opt=opt, ref=ref, mgr=mgr)


def _disjoint_cover(md):
    chunks = md.chunks
    volume = sum(torch.Size(c.sizes).numel() for c in chunks)
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            overlap = all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
            )
            assert not overlap or len(a.offsets) == 0, (a, b)
    return volume == md.size.numel()


def test_every_tensor_is_written_once_and_completely(saved):
    md = SafeFileSystemReader(os.path.join(CKPT, "mgr", "10")).read_metadata()
    tensors = {
        k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    }
    assert sorted(tensors) == sorted(saved.ref)
    for fqn, v in tensors.items():
        assert tuple(v.size) == tuple(saved.ref[fqn].shape), fqn
        assert _disjoint_cover(v), fqn
    # split on 'model', replicated on 'data': torch_xla 2.9 drops it; here both halves, once
    w = tensors["tp.0.weight"]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in w.chunks] == [
        ((0, 0), (16, 16)),
        ((16, 0), (16, 16)),
    ]
    assert len(tensors["tp.2.weight"].chunks) == 2  # (None, 'model')
    assert len(tensors["opt_tp.state.0.exp_avg"].chunks) == 2  # AdamW state sharded like its param
    assert len(tensors["fsdp._orig_module.0.weight"].chunks) == 4  # FSDPv2 over 4 devices
    assert len(tensors["opt_fsdp.state.0.exp_avg"].chunks) == 4
    # the files hold each block once: one storage entry per chunk, none for the replicas
    items = [i for i in md.storage_data if i.fqn == "tp.0.weight"]
    assert len(items) == 2


def test_save_plan_holds_this_process_replica_zero_shards_only(saved):
    planner = SPMDSavePlanner()
    planner.set_up_planner({"w": saved.tp[0].weight}, is_coordinator=True)
    plan = planner.create_local_plan()
    assert sorted(tuple(i.index.offset) for i in plan.items) == [(0, 0), (16, 0)]
    host = saved.tp[0].weight.detach().cpu()
    for item in plan.items:
        data = planner.resolve_data(item)
        assert torch.equal(data, host[item.index.offset[0] : item.index.offset[0] + 16])


def test_restore_into_the_same_mesh_is_bit_identical_and_trains_on(saved):
    tp, fsdp, opt = _fresh(seed=7)
    sd = state(tp, fsdp, opt)
    layout = specs(sd)
    saved.mgr.restore(10, sd)
    assert_equal(sd, saved.ref)
    assert specs(sd) == layout  # every tensor kept its own sharding
    assert torch.equal(tp[0].weight.detach().cpu(), saved.ref["tp.0.weight"])  # the parameter
    step(saved.tp, saved.fsdp, saved.opt, DEV, seed=2)
    step(tp, fsdp, opt, DEV, seed=2)
    assert_equal(state(tp, fsdp, opt), host_copy(state(saved.tp, saved.fsdp, saved.opt)))


def test_front_door_dcp_save_and_load(saved, tmp_path):
    import torch_xla.distributed.spmd as xs

    sd = state(saved.tp, saved.fsdp, saved.opt)
    half = torch.randn(8, 4).to(torch.bfloat16)
    rows = torch.randn(50, 6)  # 4 devices do not divide 50 rows: padded to 52
    sd["extra"] = {
        "bf16": xs.mark_sharding(half.to(DEV), TP_MESH, ("data", "model")).global_tensor,
        "pending": saved.tp[0].weight * 2,  # not computed yet: the planner runs the step
        "padded": xs.mark_sharding(rows.to(DEV), FSDP_MESH, ("fsdp", None)).global_tensor,
        "to_pad": rows.t().contiguous().to(DEV),  # replicated
    }
    assert tuple(value_of(sd["extra"]["padded"]).buf.shape) == (52, 6)
    ref = host_copy(sd)
    assert torch.equal(ref["extra.bf16"], half)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path)), planner=SPMDSavePlanner())
    md = SafeFileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["extra.padded"]
    assert [(c.offsets[0], c.sizes[0]) for c in md.chunks] == [
        (0, 13),
        (13, 13),
        (26, 13),
        (39, 11),
    ]
    tp, fsdp, opt = _fresh(seed=8)
    target = state(tp, fsdp, opt)
    bf16 = torch.zeros(8, 4, dtype=torch.bfloat16).to(DEV)
    xs.mark_sharding(bf16, TP_MESH, (None, ("data", "model")))  # another layout
    to_pad = torch.zeros(6, 50).to(DEV)
    xs.mark_sharding(to_pad, FSDP_MESH, (None, "fsdp"))  # padded to 52 columns
    target["extra"] = {
        "bf16": bf16,
        "pending": torch.zeros(32, 16),  # a CPU tensor
        "padded": xs.mark_sharding(torch.zeros(50, 6).to(DEV), TP_MESH, ("model", None)),
        "to_pad": to_pad,
    }
    target["extra"]["padded"] = target["extra"]["padded"].global_tensor
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path)), planner=SPMDLoadPlanner())
    assert_equal(target, ref)
    assert tuple(value_of(to_pad).buf.shape) == (6, 52)  # still padded, its zeros included
    assert spec_of(to_pad)[3] == ((0, 6), (39, 52))
    assert torch.equal((to_pad * 2).cpu(), ref["extra.to_pad"] * 2)  # and usable in a step
    assert bf16.dtype == torch.bfloat16
    opt.opts[0].load_state_dict(target["opt_tp"])  # param groups came back as plain values
    assert opt.opts[0].param_groups[0]["lr"] == 1e-2


def test_shape_mismatch_raises_before_changing_anything(saved):
    tp, fsdp, opt = _fresh(seed=9)
    sd = state(tp, fsdp, opt)
    bad = torch.zeros(24, 16).to(DEV)
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(bad, TP_MESH, ("model", None))
    sd["tp"]["0.weight"] = bad
    before = host_copy(sd)
    pattern = (
        r"'tp\.0\.weight' of shape \(24, 16\) \(partition spec \('model', None\) on mesh "
        r"\{'data': 2, 'model': 2\}\): the checkpoint's tensor has shape \(32, 16\)"
    )
    with pytest.raises(ValueError, match=pattern):
        saved.mgr.restore(10, sd)
    assert_equal(sd, before)
    # the same check inside DCP's own load (which wraps planner errors)
    with pytest.raises(CheckpointException, match=pattern):
        dcp.load(
            sd,
            storage_reader=dcp.FileSystemReader(os.path.join(CKPT, "mgr", "10")),
            planner=SPMDLoadPlanner(),
        )
    assert_equal(sd, before)
    with pytest.raises(ValueError, match=r"no checkpoint of step 11.*\[10\]"):
        saved.mgr.restore(11, sd)


def test_a_corrupt_checkpoint_changes_no_device_tensor_all_or_nothing(saved, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(CKPT, "mgr", "10"), broken)
    (data,) = [f for f in os.listdir(broken) if f.endswith(".distcp")]
    size = os.path.getsize(broken / data)
    with open(broken / data, "r+b") as f:
        f.truncate(size * 2 // 3)  # the last third of the blocks is gone
    tp, fsdp, opt = _fresh(seed=12)
    sd = state(tp, fsdp, opt)
    flat, _ = flatten_state_dict(sd)
    on_device = {k: v for k, v in flat.items() if getattr(v, "device", None) == DEV}
    assert len(on_device) == 24  # 8 parameters and their AdamW moments
    before = {k: v.cpu() for k, v in on_device.items()}

    def load(**kw):
        with pytest.raises(CheckpointException):
            reader = SafeFileSystemReader(str(broken))
            dcp.load(sd, storage_reader=reader, planner=SPMDLoadPlanner(**kw))
        return [k for k, v in on_device.items() if not torch.equal(v.cpu(), before[k])]

    # the reads that succeeded were not installed: every device tensor is as it was
    assert load(all_or_nothing=True) == []
    # torch_xla's way (the default): each tensor as soon as it is read
    assert load() != []


def test_crash_mid_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    sd = state(saved.tp, saved.fsdp, saved.opt)
    real = dcp_fs._write_item
    calls = []

    def crash_after_one(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk gone")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", crash_after_one)
    with pytest.raises(BaseException, match="disk gone"):
        saved.mgr.save(20, sd)
    monkeypatch.undo()
    assert len(calls) == 2  # it did crash half way
    base = os.path.join(CKPT, "mgr")
    assert saved.mgr.all_steps() == [10]
    assert CheckpointManager(base, save_interval=10).all_steps() == [10]
    assert not os.path.exists(os.path.join(base, "20"))
    tp, fsdp, opt = _fresh(seed=10)
    target = state(tp, fsdp, opt)
    saved.mgr.restore(10, target)
    assert_equal(target, saved.ref)
    # the next save of the step replaces the leftover and counts
    ref20 = host_copy(sd)
    assert saved.mgr.save(20, sd)
    assert saved.mgr.all_steps() == [10, 20]
    assert sorted(os.listdir(base)) == ["10", "20"]
    torch.save(ref20, os.path.join(CKPT, "reference-20.pt"))


def test_save_async_writes_the_state_of_its_step(saved):
    sd = state(saved.tp, saved.fsdp, saved.opt)
    ref30 = host_copy(sd)
    assert saved.mgr.save_async(30, sd)
    step(saved.tp, saved.fsdp, saved.opt, DEV, seed=3)  # training goes on meanwhile
    saved.mgr.join()
    if sys.platform.startswith("linux"):  # the writer thread runs writer_nice (10) lower
        tid = saved.mgr._pool.submit(threading.get_native_id).result()
        main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(main + 10, 19)
    assert saved.mgr.all_steps() == [20, 30]  # max_to_keep=2 dropped step 10
    assert sorted(os.listdir(os.path.join(CKPT, "mgr"))) == ["20", "30"]
    tp, fsdp, opt = _fresh(seed=11)
    target = state(tp, fsdp, opt)
    saved.mgr.restore(30, target)
    assert_equal(target, ref30)
    assert not torch.equal(saved.tp[0].weight.detach().cpu(), ref30["tp.0.weight"])
    torch.save(ref30, os.path.join(CKPT, "reference-30.pt"))


class Payload:
    def __reduce__(self):
        return (open, (os.path.join(CKPT, "pwned"), "w"))


class Custom:
    pass


def test_loading_is_weights_only(saved, tmp_path):
    # .metadata: DCP's FileSystemReader unpickles it with plain pickle; ours refuses strangers
    evil = tmp_path / "evil"
    shutil.copytree(os.path.join(CKPT, "mgr", "20"), evil)
    md = SafeFileSystemReader(str(evil)).read_metadata()
    md.planner_data = Payload()
    with open(evil / ".metadata", "wb") as f:
        pickle.dump(md, f)
    marker = os.path.join(CKPT, "pwned")
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        SafeFileSystemReader(str(evil)).read_metadata()
    assert not os.path.exists(marker)
    dcp.FileSystemReader(str(evil)).read_metadata()  # what plain DCP does: runs the payload
    assert os.path.exists(marker)
    os.remove(marker)
    # non-tensor values: SPMDLoadPlanner loads them with weights_only=True
    plain = tmp_path / "plain"
    dcp.save({"obj": Custom(), "x": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(plain)))
    target = {"obj": None, "x": torch.zeros(2)}
    with pytest.raises(CheckpointException, match="Unsupported global|weights_only"):
        dcp.load(target, storage_reader=SafeFileSystemReader(str(plain)), planner=SPMDLoadPlanner())
    assert target["obj"] is None


def test_manager_arguments_and_incomplete_directories(tmp_path):
    with pytest.raises(ValueError, match="save_interval must be positive, got 0"):
        CheckpointManager(str(tmp_path), 0)
    with pytest.raises(ValueError, match="max_to_keep must be >= 0, got -1"):
        CheckpointManager(str(tmp_path), 1, max_to_keep=-1)
    with pytest.raises(ValueError, match="writer_nice must be in 0..19, got -1"):
        CheckpointManager(str(tmp_path), 1, writer_nice=-1)
    with pytest.raises(NotImplementedError, match="preemption"):
        CheckpointManager(str(tmp_path), 1, chkpt_on_preemption=True)
    (tmp_path / "7").mkdir()  # no metadata: not a checkpoint
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / ".manager_metadata").write_text('{"step": 8, "ts": 0}')  # no .metadata
    mgr = CheckpointManager(str(tmp_path), 1)
    assert mgr.all_steps() == []
    assert mgr.should_save(3) and not CheckpointManager(str(tmp_path), 2).should_save(3)
