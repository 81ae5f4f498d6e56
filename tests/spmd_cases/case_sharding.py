"""SPMD sharding on 4 CPU devices (run by tests/test_spmd.py with CPU_NUM_DEVICES=4).

Parity with eager PyTorch for 2-D data x model sharding and FSDPv2, compile counts, per-device
bytes, torch_xla's sharding text and shards, constraints on activations, and bad input.
"""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from compile_counts import new_graphs  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla._XLAC as _XLAC  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.distributed import sharding as engine  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

xr.use_spmd()
DEV = torchacc.device()


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _params_close(model, ref, tol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach().cpu() - q.detach()).abs().max().item()
        assert err <= tol, f"{name}: {err}"


def test_device_counts():
    assert xr.is_spmd()
    assert xr.global_runtime_device_count() == 4
    assert xr.addressable_runtime_device_count() == 4
    assert xr.local_device_count() == 4


def _train_2d(mesh, steps=6):
    torch.manual_seed(0)
    ref, model = _mlp(), _mlp()
    model.load_state_dict(ref.state_dict())
    model.to(DEV)
    xs.mark_sharding(model[0].weight, mesh, ("model", None))
    xs.mark_sharding(model[0].bias, mesh, ("model",))
    xs.mark_sharding(model[2].weight, mesh, (None, "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        xd, yd = x.to(DEV), y.to(DEV)
        xs.mark_sharding(xd, mesh, ("data", None))
        before = new_graphs()
        loss = torch.nn.functional.mse_loss(model(xd), yd)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        graphs.append(new_graphs() - before)
        rloss = torch.nn.functional.mse_loss(ref(x), y)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        assert abs(loss.item() - rloss.item()) <= 1e-5
    return model, ref, opt, graphs


def test_mlp_2d_data_model_sharding_matches_eager_and_compiles_once():
    from torchacc import metrics

    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    known = metrics.counter_value("KnownStep") or 0
    model, ref, opt, graphs = _train_2d(mesh)
    # the batch is resharded every step, and the steady steps still launch as known steps
    assert (metrics.counter_value("KnownStep") or 0) - known >= 3
    _params_close(model, ref)
    assert graphs[2:] == [0] * (len(graphs) - 2), graphs  # no new program after step 2
    w = model[0].weight
    assert _XLAC._get_xla_sharding_spec(w) == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    # the optimizer state stayed sharded like its parameter
    state = opt.state[w]["exp_avg"]
    assert _XLAC._get_xla_sharding_spec(state) == _XLAC._get_xla_sharding_spec(w)
    per_device = engine.per_device_bytes([w, state])
    assert set(per_device) == {0, 1, 2, 3}
    assert all(b == 2 * w.numel() * 4 // 2 for b in per_device.values())  # half of each, x2


def test_sharding_text_forms_match_torch_xla():
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    t = torch.arange(32.0).reshape(8, 4).to(DEV)
    cases = {
        ("data", "model"): "{devices=[2,2]0,1,2,3}",
        (None, "model"): "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}",
        (("data", "model"), None): "{devices=[4,1]0,1,2,3}",
        (None, None): "{replicated}",
        (1, 0): "{devices=[2,2]0,2,1,3}",
    }
    for spec, text in cases.items():
        xs.mark_sharding(t, mesh, spec)
        assert _XLAC._get_xla_sharding_spec(t) == text, spec
    assert torch.equal(t.cpu(), torch.arange(32.0).reshape(8, 4))  # values unchanged


def test_hlo_text_debug_info_and_counters_read_like_torch_xla():
    """What torch_xla's tests read: the lowered program's HLO with the parameters' shardings in
    V1 form and a mark of a pending value as a Sharding custom-call, the tensor debug text, one
    CreateOpSharding per (mesh, spec), ReplicateShardedData on reads of sharded data, and the
    spmd.debugging / spmd.api modules."""
    import copy

    import torchacc.torch_xla.debug.metrics as met
    from torchacc.torch_xla.distributed.spmd.api import convert_to_xla_mesh
    from torchacc.torch_xla.distributed.spmd.debugging import visualize_tensor_sharding

    met.clear_all()
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    x = torch.arange(32.0).reshape(8, 4).to(DEV)
    assert _XLAC._get_xla_sharding_spec(x) == ""  # an upload never marked
    xs.mark_sharding(x, mesh, (None, "model"))
    xs.mark_sharding(torch.zeros(2, 2).to(DEV), mesh, (None, "model"))  # same spec, rank
    assert met.counter_value("CreateOpSharding") == 1
    spec = "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
    assert f"parameter(0), sharding={spec}" in _XLAC._get_xla_tensors_hlo([x])
    y = x * 2
    xs.mark_sharding(y, mesh, ("data", None))
    hlo = _XLAC._get_xla_tensors_hlo([y])
    assert 'custom_call_target="Sharding", sharding={devices=[2,1,2]0,1,2,3' in hlo, hlo
    info = _XLAC._get_xla_tensor_debug_info(x)
    assert f"OpSharding: {spec}" in info and "NumShards: 4" in info, info
    assert _XLAC._get_xla_sharding_spec(copy.deepcopy(x)) == spec  # kept on the devices
    before = met.counter_value("ReplicateShardedData") or 0
    assert torch.equal(y.cpu(), torch.arange(32.0).reshape(8, 4) * 2)
    assert met.counter_value("ReplicateShardedData") == before + 1
    table = visualize_tensor_sharding(x, use_color=False)
    assert table.row_count == 1 and len(table.columns) == 2
    dt = torch.distributed.device_mesh.DeviceMesh("xla", torch.arange(4).reshape(2, 2))
    converted = convert_to_xla_mesh(dt)
    assert converted.mesh_shape == (2, 2) and list(converted.device_ids) == [0, 1, 2, 3]


def test_local_shards_hold_the_slices_of_the_global_tensor():
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    host = torch.arange(32.0).reshape(8, 4)
    st = xs.mark_sharding(host.to(DEV), mesh, (None, "model"))
    assert st.sharding_spec == "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
    shards = st.local_shards
    assert [s.ordinal for s in shards] == [0, 1, 2, 3]
    for s in shards:
        assert torch.equal(s.data, host[s.indices])
        assert s.data.shape == (8, 2)
    assert sorted(s.replica_id for s in shards) == [0, 0, 1, 1]
    assert torch.equal((st * 2).cpu(), host * 2)  # usable as its global tensor
    host_copy = st.cpu()  # torch_xla wraps every tensor an op on a sharded tensor returns
    assert isinstance(host_copy, xs.XLAShardedTensor) and host_copy.device.type == "cpu"
    assert host_copy.global_tensor.device.type == "cpu"
    assert torch.equal(host_copy.global_tensor, host)


def test_activation_constraint_and_hybrid_mesh():
    mesh = xs.HybridMesh(ici_mesh_shape=(2, 2), axis_names=("data", "model"))
    assert mesh.device_ids.tolist() == [0, 1, 2, 3]
    x = torch.randn(8, 16)
    w = torch.randn(16, 4)
    xd, wd = x.to(DEV), w.to(DEV)
    h = xd @ wd  # pending
    xs.mark_sharding(h, mesh, ("data", "model"))
    out = (h * 3).sum(0)
    torchacc.sync()
    assert torch.allclose(out.cpu(), ((x @ w) * 3).sum(0), atol=1e-5)
    assert _XLAC._get_xla_sharding_spec(h) == "{devices=[2,2]0,1,2,3}"


def test_fsdpv2_gpt_tiny_matches_eager_with_a_quarter_of_the_memory():
    from gallery.gpt.model import build_gpt

    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    ref, model = build_gpt("gpt-tiny"), build_gpt("gpt-tiny")
    model.load_state_dict(ref.state_dict())
    model = FSDPv2(model.to(DEV), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for _ in range(5):
        x = torch.randint(0, 512, (8, 32), generator=gen)
        y = torch.randint(0, 512, (8, 32), generator=gen)
        xd, yd = x.to(DEV), y.to(DEV)
        xs.mark_sharding(xd, mesh, ("fsdp", None))
        before = new_graphs()
        loss = torch.nn.functional.cross_entropy(model(xd).view(-1, 512), yd.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        graphs.append(new_graphs() - before)
        rloss = torch.nn.functional.cross_entropy(ref(x).view(-1, 512), y.view(-1))
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        assert abs(loss.item() - rloss.item()) <= 1e-5
    _params_close(model, ref)
    assert graphs[2:] == [0, 0, 0], graphs
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    per_device = engine.per_device_bytes(params + state)
    full = sum(p.numel() * p.element_size() for p in ref.parameters()) * 3
    assert max(per_device.values()) <= full / 4 * 1.05, (per_device, full)
    report = engine.memory_report(model, opt)
    assert report["gradients"] == {}  # zero_grad(set_to_none) left none
    assert max(report["optimizer_state"].values()) <= full * 2 / 3 / 4 * 1.05
    from torchacc.torch_xla.core import xla_model as xm

    live = xm.get_memory_info(DEV)["tensor_bytes_per_device"]
    assert set(live) == {0, 1, 2, 3} and min(live.values()) >= max(per_device.values())


def test_bad_input_names_shape_spec_and_mesh():
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    t = torch.ones(8, 4).to(DEV)
    before = _XLAC._get_xla_sharding_spec(t)
    with pytest.raises(ValueError, match=r"8 device ids.*job has 4 device"):
        xs.Mesh(np.arange(8), (4, 2))  # a mesh larger than the job
    with pytest.raises(ValueError, match="holds 8 devices"):
        xs.Mesh(np.arange(4), (4, 2))
    with pytest.raises(ValueError, match="repeated device ids"):
        xs.Mesh([0, 1, 1, 2], (2, 2))
    with pytest.raises(ValueError, match=r"3 entries.*shape \(8, 4\).*mesh"):
        xs.mark_sharding(t, mesh, ("data", None, None))
    with pytest.raises(ValueError, match=r"'tensor'.*shape \(8, 4\).*not an axis"):
        xs.mark_sharding(t, mesh, ("tensor", None))
    with pytest.raises(ValueError, match="used twice"):
        xs.mark_sharding(t, mesh, ("data", "data"))
    assert _XLAC._get_xla_sharding_spec(t) == before  # nothing half-applied
    with pytest.raises(ValueError, match="torchacc device"):
        xs.mark_sharding(torch.ones(8, 4), mesh, ("data", None))
    with pytest.raises(ValueError, match="'fsdp'"):
        FSDPv2(torch.nn.Linear(4, 4).to(DEV), mesh)


def test_uneven_dimension_is_padded_and_trains_like_eager():
    """A 50-row embedding (GPT-2's 50,257 rows in small) over 4 devices: shards of 13 rows,
    the last one padded, values and training unchanged, the layout kept across steps."""
    mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Embedding(50, 6), torch.nn.Linear(6, 3))
    model = torch.nn.Sequential(torch.nn.Embedding(50, 6), torch.nn.Linear(6, 3))
    model.load_state_dict(ref.state_dict())
    model.to(DEV)
    emb = model[0].weight
    st = xs.mark_sharding(emb, mesh, ("fsdp", None))
    assert st.sharding_spec == "{devices=[4,1]0,1,2,3}"
    assert torch.equal(emb.cpu(), ref[0].weight.detach())
    shards = st.local_shards
    assert [s.data.shape[0] for s in shards] == [13, 13, 13, 11]
    for s in shards:
        assert torch.equal(s.data, ref[0].weight.detach()[s.indices])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(2)
    graphs = []
    for _ in range(5):
        idx = torch.randint(0, 50, (8,), generator=gen)
        before = new_graphs()
        loss = model(idx.to(DEV)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept: they stay sharded like the weight
        torchacc.sync()
        graphs.append(new_graphs() - before)
        rloss = ref(idx).square().mean()
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        assert abs(loss.item() - rloss.item()) <= 1e-6
    _params_close(model, ref, 1e-6)
    assert graphs[2:] == [0, 0, 0], graphs
    assert _XLAC._get_xla_sharding_spec(emb) == "{devices=[4,1]0,1,2,3}"
    momentum = opt.state[emb]["momentum_buffer"]
    for t in (emb, emb.grad, momentum):  # the padded layout, 13 rows a device
        assert set(engine.per_device_bytes([t]).values()) == {13 * 6 * 4}
        assert _XLAC._get_xla_sharding_spec(t) == "{devices=[4,1]0,1,2,3}"


def test_fsdpv2_with_gradient_checkpointing_and_auto_wrap():
    """FSDPv2 wrapping each block (auto_wrap_policy) whose forward is checkpointed
    (torch.utils.checkpoint): the same losses and weights as eager."""
    import functools

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return checkpoint(lambda y: torch.tanh(self.fc(y)), x, use_reentrant=False)

    def make():
        return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 4))

    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    ref, model = make(), make()
    model.load_state_dict(ref.state_dict())
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDPv2(model.to(DEV), mesh, auto_wrap_policy=policy)
    assert isinstance(model.module[0], FSDPv2) and not isinstance(model.module[2], FSDPv2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 16, generator=gen)
        xd = x.to(DEV)
        xs.mark_sharding(xd, mesh, ("fsdp", None))
        loss = model(xd).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        rloss = ref(x).square().mean()
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        assert abs(loss.item() - rloss.item()) <= 1e-6
    _params_close(model, ref, 1e-6)
    assert _XLAC._get_xla_sharding_spec(model.module[0].fc.weight) == "{devices=[4,1]0,1,2,3}"


def test_a_step_mixing_two_meshes_runs_on_the_last_one():
    """Data replicated on one mesh meets data split on two other meshes over the same devices:
    the step gives the eager result (replicated data moves onto the last mesh used)."""
    a, b, c = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    ad = a.to(DEV)
    xs.mark_sharding(ad, xs.get_1d_mesh("x"), (None, None))  # replicated on a 1-D mesh
    cd = c.to(DEV)
    xs.mark_sharding(cd, xs.get_1d_mesh("y"), ("y", None))  # split on another 1-D mesh
    bd = b.to(DEV)
    mesh2 = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    xs.mark_sharding(bd, mesh2, ("data", "model"))  # split on a 2-D mesh
    out = (ad * bd + cd).sum(1)
    torchacc.sync()
    assert torch.allclose(out.cpu(), (a * b + c).sum(1), atol=1e-6)


def test_mp_device_loader_input_sharding():
    """MpDeviceLoader(..., input_sharding=ShardingSpec | {key: ShardingSpec}) shards each batch
    as torch_xla does; a dict spec for a tensor batch is a ValueError, a missing key KeyError."""
    from torchacc.torch_xla.distributed import parallel_loader as pl

    mesh = xs.get_1d_mesh("x")
    batches = [{"x": torch.randn(16, 8), "y": torch.randn(16, 8, 2)} for _ in range(2)]
    spec = {"x": xs.ShardingSpec(mesh, ("x", None)), "y": xs.ShardingSpec(mesh, ("x", None, None))}
    for b, data in zip(batches, pl.MpDeviceLoader(batches, DEV, input_sharding=spec)):
        assert _XLAC._get_xla_sharding_spec(data["x"]) == "{devices=[4,1]0,1,2,3}"
        assert _XLAC._get_xla_sharding_spec(data["y"]) == "{devices=[4,1,1]0,1,2,3}"
        assert torch.equal(data["y"].cpu(), b["y"])
    one = pl.MpDeviceLoader(batches, DEV, input_sharding=xs.ShardingSpec(mesh, ("x", None)))
    data = next(iter(one))
    assert _XLAC._get_xla_sharding_spec(data["x"]) == "{devices=[4,1]0,1,2,3}"
    assert _XLAC._get_xla_sharding_spec(data["y"]) == "{replicated}"  # rank 3: not applied
    with pytest.raises(ValueError, match="not a dict"):
        next(iter(pl.MpDeviceLoader([torch.ones(4, 2)], DEV, input_sharding=spec)))
    with pytest.raises(KeyError, match="'y'"):
        next(iter(pl.MpDeviceLoader(batches, DEV, input_sharding={"x": spec["x"]})))


def test_minibatch_loader_needs_a_batch_the_local_devices_divide():
    """``ShardingSpec(minibatch=True)``: each host's batch is split over its devices; 3 rows on
    4 devices is torch_xla's RuntimeError, 8 rows are laid out."""
    from torchacc.torch_xla.distributed import parallel_loader as pl

    mesh = xs.get_1d_mesh("data")
    spec = xs.ShardingSpec(mesh, ("data", None), minibatch=True)
    with pytest.raises(RuntimeError, match=r"per-host batch size must be divisible by local "):
        next(iter(pl.MpDeviceLoader([torch.zeros(3, 2)], DEV, input_sharding=spec)))
    data = next(iter(pl.MpDeviceLoader([torch.ones(8, 2)], DEV, input_sharding=spec)))
    assert _XLAC._get_xla_sharding_spec(data) == "{devices=[4,1]0,1,2,3}"


def test_moved_data_stays_on_the_host_until_its_layout_is_known():
    """torch_xla's virtual device (Note [Deferred uploads] in torchacc/engine/transfer.py):
    ``.to(device)`` keeps the data on the host; ``mark_sharding`` sends each device its shard
    once (not a replicated copy and a reshard), an op recording it or a sync uploads it
    replicated, and reads answer from the host copy."""
    import torchacc.torch_xla.core.xla_model as xm
    import torchacc.torch_xla.debug.metrics as met

    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    met.clear_all()
    host = torch.arange(32.0).reshape(8, 4)
    x = host.to(DEV)
    host.add_(100)  # the device tensor holds a copy
    info = _XLAC._get_xla_tensor_debug_info(x)
    assert "Tensor on host: with size [8, 4]" in info and "Device: SPMD:0" in info, info
    assert "TransferToDeviceTime" not in met.metric_names()
    assert _XLAC._get_xla_sharding_spec(x) == ""
    assert "XLAData: None" in info
    assert torch.equal(x.cpu(), torch.arange(32.0).reshape(8, 4))  # read from the host copy
    assert met.counter_value("TransferFromDevice") is None
    xs.mark_sharding(x, mesh, ("data", "model"))
    assert met.counter_value("VirtualDeviceUsage") == 1
    assert met.counter_value("TransferToDevice") == 1
    assert met.metric_data("OutboundData")[1] == 32 * 4  # 4 shards of 8: the tensor once
    assert _XLAC._get_xla_sharding_spec(x) == "{devices=[2,2]0,1,2,3}"
    assert "XLAShardedData" in _XLAC._get_xla_tensor_debug_info(x)
    x2 = x * 2
    # a dimension that does not divide: the host copy is padded before the sharded upload
    y = torch.arange(6.0).reshape(3, 2).to(DEV)
    xs.mark_sharding(y, mesh, (("data", "model"), None))
    y1 = y + 1
    # recorded as an op's input: uploaded replicated at once; in-place and partial writes
    z = torch.ones(4).to(DEV)
    w = z + 1
    assert "Tensor on host: None" in _XLAC._get_xla_tensor_debug_info(z)
    assert _XLAC._get_xla_sharding_spec(z) == ""  # still an upload never marked
    z.mul_(3)
    e = torch.zeros(4, device=DEV)
    e[1:3] = torch.tensor([5.0, 6.0])
    kept = torch.ones(3).to(DEV)
    torchacc.sync()  # as torch_xla's sync: data still on the host goes up replicated
    info = _XLAC._get_xla_tensor_debug_info(kept)
    assert "Tensor on host: None" in info and "OpSharding: {replicated}" in info, info
    assert w.tolist() == [2.0] * 4 and z.tolist() == [3.0] * 4 and e.tolist() == [0, 5, 6, 0]
    assert torch.equal(x2.cpu(), torch.arange(32.0).reshape(8, 4) * 2)
    assert torch.equal(y1.cpu(), torch.arange(6.0).reshape(3, 2) + 1)
    # torch_xla's loader door: the input sharding is applied by the one upload
    spec = xs.ShardingSpec(mesh, ("data", None))
    (b,) = xm.send_cpu_data_to_device([torch.ones(4, 2)], DEV, input_sharding=spec)
    assert _XLAC._get_xla_sharding_spec(b) == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
    # torch_xla's error text, word for word, for placements of a tensor with no sharding
    with pytest.raises(ValueError, match=r"^Placements not available: XLAShardedTensor requires"):
        _ = xs.XLAShardedTensor(torch.ones(2)).placements


def test_lowering_context_parameters_and_graph_hash():
    """``_XLAC.lowering.LoweringContext``: the program of some pending tensors, its data
    parameters (sharded, as device tensors without a transfer) and ``_get_graph_hash``."""
    import torchacc.torch_xla.debug.metrics as met

    mesh = xs.Mesh(np.arange(4), (2, 2), ("x", "y"))
    a = torch.arange(8.0).reshape(2, 4).to(DEV)
    xs.mark_sharding(a, mesh, ("x", "y"))
    b = torch.ones(4).to(DEV)
    r = a * 2 + b
    met.clear_all()
    ctx = _XLAC.lowering.LoweringContext("MyCustomName")
    ctx.build([r])
    text = ctx.hlo_text()
    assert "HloModule jit_MyCustomName" in text and "sharding={devices=[2,2]0,1,2,3}" in text
    assert isinstance(ctx.hlo(), bytes) and ctx.hlo()
    mapping = ctx.device_parameter_id_tensor_mapping()
    ia, ib = ctx.tensor_parameter_id(a), ctx.tensor_parameter_id(b)
    assert sorted(mapping) == sorted([ia, ib]) and ctx.tensor_parameter_id(r) == -1
    assert _XLAC._get_xla_sharding_spec(mapping[ia]) == "{devices=[2,2]0,1,2,3}"
    assert met.counter_value("TransferFromDevice") is None  # the device mapping reads nothing
    host = ctx.parameter_id_tensor_mapping()
    assert torch.equal(host[ia], torch.arange(8.0).reshape(2, 4)) and host[ib].tolist() == [1] * 4
    with pytest.raises(ValueError, match="additional_inputs_list"):
        ctx.build([r], [a])
    h = _XLAC._get_graph_hash([a * 2 + b])
    assert isinstance(h, bytes) and len(h) == 16 and h == _XLAC._get_graph_hash([r])
    assert h != _XLAC._get_graph_hash([a * 2 - b])
    c = torch.arange(8.0).reshape(2, 4).to(DEV) + 0  # same ops, a replicated input
    assert _XLAC._get_graph_hash([c * 2 + b]) != _XLAC._get_graph_hash([a * 2 + b])
    torchacc.sync()
    assert torch.equal(r.cpu(), torch.arange(8.0).reshape(2, 4) * 2 + 1)


def test_graph_dumps_to_xla_save_tensors_file(tmp_path, monkeypatch):
    """``XLA_SAVE_TENSORS_FILE``/``_FMT=hlo``: each sync appends its graph and the layouts its
    outputs got, in torch_xla's layout (``<file>.0``)."""
    from torchacc.torch_xla import _graph_dump

    base = tmp_path / "graphs.txt"
    monkeypatch.setenv("XLA_SAVE_TENSORS_FILE", str(base))
    monkeypatch.setenv("XLA_SAVE_TENSORS_FMT", "hlo")
    mesh = xs.Mesh(np.arange(4), (1, 4), ("x", "y"))
    x = torch.ones(8, 32).to(DEV)
    y = torch.ones(8, 32).to(DEV)
    xs.mark_sharding(x, mesh, (0, 1))
    torchacc.sync()  # uploads only: no graph
    _graph_dump.install()
    try:
        r = x + y
        torchacc.sync()
        torchacc.sync()  # nothing pending: nothing written
        r = r * 2
        torchacc.sync()
    finally:
        _graph_dump.uninstall()
    text = (tmp_path / "graphs.txt.0").read_text()
    assert text.count("[ScheduleSyncTensorsGraph]") == 2 and text.count("## END_GRAPH") == 2
    assert "parameter(0), sharding={devices=[1,4]0,1,2,3}" in text and "add(" in text
    lines = text.splitlines(keepends=True)
    assert lines[-2] == "#OUTPUT_SHARDING_END\n", lines[-4:]
    assert "\n#OUTPUT_SHARDING_BEGIN\n\nf32[8,32] {devices=[1,4]0,1,2,3}\n" in text
    assert r.tolist() == [[4.0] * 32] * 8
    r = r + 1
    torchacc.sync()  # uninstalled: nothing more
    assert (tmp_path / "graphs.txt.0").read_text() == text
