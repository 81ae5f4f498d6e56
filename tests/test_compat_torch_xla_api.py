"""The torch_xla API beyond xla_model's basics: spmd, the names scripts call (xm, xr, _XLAC, core,
utils, debug, experimental, backends, test), metrics names/units, async closures, the xla://
rendezvous, and the docs' coverage table generated from the code."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import torchacc
import torchacc.torch_xla as torch_xla
import torchacc.torch_xla.core.xla_model as xm
import torchacc.torch_xla.debug.metrics as met
import torchacc.torch_xla.distributed.spmd as xs
import torchacc.torch_xla.runtime as xr
from torchacc.torch_xla import _XLAC, _coverage

ROOT = Path(__file__).resolve().parent.parent


# --- coverage table ------------------------------------------------------------------------------


def test_readme_coverage_table_is_generated_from_the_code():
    page = (ROOT / "docs" / "torch-xla.md").read_text()
    assert _coverage.readme_section(page) == _coverage.table(), (
        "docs/torch-xla.md's torch_xla coverage table is stale: run "
        "python -m torchacc.torch_xla._coverage --write docs/torch-xla.md"
    )


def test_every_listed_torch_xla_name_exists():
    missing = [(m, n) for m, n, status, _ in _coverage.rows() if status == "missing"]
    assert missing == []


def test_not_implemented_names_raise_not_implemented_with_reason():
    for module_name, name, status, note in _coverage.rows():
        if status != "not implemented":
            continue
        obj = _coverage._lookup(module_name, name)
        with pytest.raises(NotImplementedError, match=name.lstrip("_")[:6]):
            obj()
        assert note


# --- spmd ----------------------------------------------------------------------------------------


def test_spmd_mesh_of_this_process_and_replicated_annotations():
    """Without use_spmd(): a mesh of this process's one device and annotations that split
    nothing work (HF Trainer's FSDPv2 mesh); sharded runs are tests/spmd_cases/."""
    n = xr.global_runtime_device_count()
    assert n == 1 and not xr.is_spmd()
    mesh = xs.Mesh(np.array(range(n)), (n, 1), axis_names=("fsdp", "tensor"))  # Trainer's FSDPv2
    assert mesh.size() == 1 and list(mesh.shape().items()) == [("fsdp", 1), ("tensor", 1)]
    assert xs.Mesh.from_str(str(mesh)).mesh_shape == (1, 1)
    xs.set_global_mesh(mesh)
    try:
        assert xs.get_global_mesh() is mesh
        t = torch.ones(4, 3).to(torchacc.device())
        st = xs.mark_sharding(t, mesh, ("fsdp", None))  # axis of size 1: nothing to split
        assert isinstance(st, xs.XLAShardedTensor) and st.global_tensor is t
        assert xs.clear_sharding(st) is t
        assert xs.get_1d_mesh("data").axis_names == ("data",)
        jm = mesh.get_jax_mesh()
        assert jm.devices.shape == (1, 1) and jm.axis_names == ("fsdp", "tensor")
        u = torch.ones(2).to(torchacc.device())
        assert xs.wrap_if_sharded(u) is u
    finally:
        xs.set_global_mesh(None)
    with pytest.raises(ValueError, match="2 device ids"):
        xs.Mesh([0, 1], (2,))
    with pytest.raises(ValueError, match="rank 2"):
        xs.mark_sharding(torch.ones(4, 3), mesh, (None,))
    with pytest.raises(ValueError, match="'model'"):
        xs.mark_sharding(torch.ones(4, 3), mesh, ("model", None))


def test_spmd_sharding_without_use_spmd_names_use_spmd(monkeypatch):
    from torchacc.torch_xla.distributed.spmd import xla_sharding

    monkeypatch.setattr(xla_sharding, "_device_count", lambda: 4)  # a job of 4 devices
    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "tensor"))
    t = torch.ones(8, 2)
    with pytest.raises(ValueError, match=r"\(8, 2\).*'fsdp' of size 4.*use_spmd"):
        xs.mark_sharding(t, mesh, ("fsdp", None))
    assert xs.mark_sharding(t, mesh, (None, "tensor")).global_tensor is t  # size-1 axis
    with pytest.raises(NotImplementedError, match="auto-sharding"):
        xr.use_spmd(auto=True)


# --- xm ------------------------------------------------------------------------------------------


def test_rng_state_round_trip_leaves_the_cpu_generator_alone():
    dev = torchacc.device()
    torch.manual_seed(11)
    assert xm.get_rng_state() == 11
    torch.rand(3, device=dev)
    state = xm.get_rng_state()
    cpu_before = torch.get_rng_state()
    a = torch.rand(4, device=dev).cpu()
    xm.set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), cpu_before)
    assert torch.equal(torch.rand(4, device=dev).cpu(), a)
    with xm.fork_rng():
        torch.rand(2, device=dev)
    b = torch.rand(4, device=dev).cpu()
    xm.set_rng_state(state)
    torch.rand(4, device=dev)
    assert torch.equal(torch.rand(4, device=dev).cpu(), b)


def test_send_cpu_data_to_device_rebuilds_nested_data():
    class Holder:
        def __init__(self):
            self.t = torch.arange(3)

    data = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "x", "h": Holder()}
    out = xm.send_cpu_data_to_device(data, xm.xla_device())
    assert out["a"][0].device.type == "torchacc" and isinstance(out["a"][1], tuple)
    assert out["a"][1][0].device.type == "torchacc" and out["a"][1][1] == 3 and out["b"] == "x"
    assert out["h"].t.device.type == "torchacc" and data["h"].t.device.type == "cpu"
    assert out["h"].t.cpu().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="not a torchacc device"):
        xm.send_cpu_data_to_device(data, "cpu")


def test_rate_tracker():
    tracker = xm.RateTracker(smooth_factor=0.0)
    tracker.add(100)
    time.sleep(0.05)
    rate = tracker.rate()
    assert 100 / 1.0 < rate <= 100 / 0.05
    assert 0 < tracker.global_rate() <= 100 / 0.05


def test_bucketized_collectives_single_process():
    dev = torchacc.device()
    xs_ = [torch.full((1000,), float(i), device=dev) for i in range(5)]  # 4000 bytes each
    assert xm._buckets(xs_, 8000 / 2**20) == [[0, 1], [2, 3], [4]]
    out = xm.reduce_scatter_bucketized("sum", xs_, 2.0, 0, 1, bucket_cap_mb=8000 / 2**20)
    assert [o.cpu()[0].item() for o in out] == [0.0, 2.0, 4.0, 6.0, 8.0]
    gathered = xm.all_gather_bucketized(xs_, bucket_cap_mb=8000 / 2**20)
    assert [g.cpu()[0].item() for g in gathered] == [0.0, 1.0, 2.0, 3.0, 4.0]
    grads = [torch.ones(3, device=dev), torch.ones(2, device=dev)]
    xm.all_reduce_bucketized_gradients(grads, scale=0.5, groups=None, pin_layout=False)
    assert grads[0].cpu().tolist() == [0.5] * 3 and grads[1].cpu().tolist() == [0.5] * 2
    with pytest.raises(TypeError, match="list of Tensors"):
        xm.reduce_scatter_bucketized("sum", xs_[0], 1.0, 0, 1)


def test_async_step_closures_run_on_a_worker_and_reraise_at_the_next_step():
    dev = torchacc.device()
    seen = []
    main = threading.current_thread().name
    x = torch.arange(4.0, device=dev) * 2
    for i in range(3):
        xm.add_step_closure(
            lambda i, t: seen.append((i, threading.current_thread().name, t.sum().item())),
            (i, x),
            run_async=True,
        )
    xm.mark_step()
    xm.wait_async_closures()
    assert [s[0] for s in seen] == [0, 1, 2]
    assert all(name != main for _, name, _ in seen) and seen[0][2] == 12.0

    def boom():
        raise ValueError("closure failed")

    xm.add_step_closure(boom, run_async=True)
    xm.mark_step()  # the failure happens on the worker; this step does not see it
    xm.wait_async_closures()
    xm.add_step_closure(lambda: None, run_async=True)
    with pytest.raises(RuntimeError, match="previously raised exception") as info:
        xm.mark_step()
    assert isinstance(info.value.__cause__, ValueError)
    xm.add_step_closure(lambda: seen.append("again"), run_async=True)
    xm.mark_step()  # the error was reported once; async closures run again
    xm.wait_async_closures()
    assert seen[-1] == "again"


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_torch_xla_names_and_units():
    met.clear_all()
    dev = torchacc.device()
    x = torch.randn(5, 7).to(dev)
    for _ in range(3):
        x = x * 1.5 + 1
        xm.mark_step()
    compiles = (met.counter_value("UncachedCompile") or 0) + (
        met.counter_value("PersistentCacheHit") or 0
    )
    assert compiles >= 1 and met.counter_value("CreateCompileHandles") == compiles
    assert "CreateCompileHandles" in met.counter_names()
    total, acc_ns, samples = met.metric_data("LazyTracing")
    assert total == len(samples) == torchacc.metrics.metric_data("TraceTime")[0] >= 2
    assert acc_ns == pytest.approx(sum(v for _, v in samples))
    secs = torchacc.metrics.metric_data("TraceTime")[1]
    assert acc_ns == pytest.approx(secs * 1e9)
    assert samples[0][0] == pytest.approx(time.time() * 1e9, rel=1e-3)
    assert met.metric_data("TensorToData")[0] == met.counter_value("TransferToDevice")
    assert "LazyTracing" in met.metric_names()
    met.clear_metrics()
    assert met.metric_data("CompileTime") is None and met.counter_value("MarkStep") == 3
    assert met.counter_value("NoSuchCounter") is None


# --- _XLAC ---------------------------------------------------------------------------------------


def test_xlac_calls_scripts_make():
    dev = torch.device(_XLAC._xla_get_default_device())
    assert dev == torchacc.device()
    a = torch.ones(3, device=dev)
    b = a * 2 + 1
    ida, idb = _XLAC._xla_get_tensor_id(a), _XLAC._xla_get_tensor_id(b)
    assert ida != idb and _XLAC._xla_get_tensor_id(a) == ida
    text = _XLAC._get_xla_tensors_text([b])
    assert "%1 = f32[3] aten::mul.Tensor(%0)" in text and "%2 = f32[3] aten::add.Tensor(%1)" in text
    hlo = _XLAC._get_xla_tensors_hlo([b])
    assert hlo.startswith("HloModule ") and "ROOT" in hlo and "f32[3]{0} add(" in hlo
    _XLAC._xla_sync_multi([b], devices=[], wait=True)
    assert "aten::mul" not in _XLAC._get_xla_tensors_text([b])  # computed: data now
    assert b.cpu().tolist() == [3.0] * 3
    _XLAC._xla_set_rng_seed(5)
    assert _XLAC._xla_get_rng_seed() == 5
    assert _XLAC._xla_counter_value("MarkStep") == met.counter_value("MarkStep")
    assert not hasattr(_XLAC, "_xla_no_such_call")
    with pytest.raises(NotImplementedError, match="_xla_no_such_call"):
        _XLAC._xla_no_such_call  # noqa: B018
    assert torch_xla._XLAC is _XLAC and torch_xla.runtime is xr


# --- core, utils, debug, experimental, backends, test ---------------------------------------------


def test_core_functions_autograd():
    from torchacc.torch_xla.core import functions as xf

    dev = torchacc.device()
    x = torch.tensor([1.0, -2.0, 3.0], device=dev, requires_grad=True)
    y = xf.all_reduce(xm.REDUCE_SUM, x, scale=0.5)
    (y * torch.tensor([1.0, 2.0, 3.0], device=dev)).sum().backward()
    assert y.cpu().tolist() == [0.5, -1.0, 1.5]
    assert x.grad.cpu().tolist() == [0.5, 1.0, 1.5]  # torch_xla: grad * scale
    g = xf.all_gather(x, dim=0)
    assert g.cpu().tolist() == [1.0, -2.0, 3.0]
    w = torch.randn(4, 3)
    inp = torch.randn(3, 6)
    out = xf.distributed_mm(w.to(dev), inp.to(dev), split=2)
    torch.testing.assert_close(out.cpu(), w @ inp, rtol=1e-5, atol=1e-5)


def test_sync_batch_norm_matches_batch_norm_on_one_replica():
    from torchacc.torch_xla.core import functions as xf

    torch.manual_seed(0)
    batch = torch.randn(6, 4, 5)
    ref = torch.nn.BatchNorm1d(4)
    ours = xf.SyncBatchNorm(4).to(torchacc.device())
    out = ours(batch.to(torchacc.device()))
    torch.testing.assert_close(out.cpu(), ref(batch), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.running_mean.cpu(), ref.running_mean, rtol=1e-5, atol=1e-6)


def test_checkpoint_replays_dropout_and_matches_plain_backward():
    from torchacc.torch_xla.utils import checkpoint as xcp

    dev = torchacc.device()
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Tanh())
    layer = layer.to(dev)
    x = torch.randn(4, 8)

    def grads(use_checkpoint, reentrant):
        layer.zero_grad()
        torch.manual_seed(3)
        inp = x.to(dev).requires_grad_(True)
        out = xcp.checkpoint(layer, inp, use_reentrant=reentrant) if use_checkpoint else layer(inp)
        after = torch.rand(2, device=dev)  # the RNG stream continues as without checkpointing
        (out.sum() + after.sum()).backward()
        return [inp.grad.cpu(), layer[0].weight.grad.cpu(), after.cpu()]

    plain = grads(False, False)
    for reentrant in (False, True):
        for a, b in zip(grads(True, reentrant), plain):
            torch.testing.assert_close(a, b)


def test_profiler_trace_and_step_trace(tmp_path):
    from torchacc.torch_xla.debug import profiler as xp

    marks = met.counter_value("MarkStep") or 0
    xp.start_trace(str(tmp_path))
    with xp.StepTrace("train_step", step_num=1):
        with xp.Trace("forward"):
            y = torch.ones(3, device=torchacc.device()) * 2
    xp.stop_trace()
    assert met.counter_value("MarkStep") == marks + 1  # StepTrace marks the step on exit
    assert y.cpu().tolist() == [2.0] * 3
    assert any(p.is_file() for p in tmp_path.rglob("*"))  # a profile was written

    @xp.trace_me("fn")
    def fn(a):
        return a + 1

    assert fn(1) == 2
    with pytest.raises(NotImplementedError, match="start_trace"):
        xp.trace("localhost:9012", str(tmp_path))


def test_experimental_backends_runtime_and_test_utils(capsys, monkeypatch):
    monkeypatch.setenv("TORCHACC_DEVICE", os.environ.get("TORCHACC_DEVICE", ""))
    from torchacc.torch_xla import backends, experimental
    from torchacc.torch_xla.test import test_utils

    experimental.eager_mode(False)
    assert experimental.is_eager_mode() is False
    with pytest.raises(NotImplementedError, match="lazily"):
        experimental.eager_mode(True)
    before = torch.get_float32_matmul_precision()
    try:
        backends.set_mat_mul_precision("high")
        assert torch.get_float32_matmul_precision() == "high"
        assert backends.get_mat_mul_precision() == "high"
        backends.set_mat_mul_precision("default")
        assert torch.get_float32_matmul_precision() == "medium"
        with pytest.raises(ValueError, match="Invalid precision"):
            backends.set_mat_mul_precision("bf16")
    finally:
        torch.set_float32_matmul_precision(before)
    xr.set_device_type(xr.device_type())  # the device already in use: accepted
    with pytest.raises(NotImplementedError, match="TPU"):
        xr.set_device_type("TPU")
    other = "CUDA" if xr.device_type() == "CPU" else "CPU"
    with pytest.raises(RuntimeError, match="already initialized"):
        xr.set_device_type(other)
    assert xr.get_num_cached_compilation_graph() >= 0 and xr.host_index() == 0
    assert xr.addressable_runtime_device_count() == 1  # one device per process
    test_utils.print_training_update(xm.xla_device(), 7, 1.25, 10.0, 9.5, epoch=2)
    test_utils.print_test_update(xm.xla_device(), 93.5, epoch=2)
    out = capsys.readouterr().out
    assert "| Training Device=torchacc:0/0 Epoch=2 Step=7 Loss=1.25000 Rate=10.00" in out
    assert "| Test Device=torchacc:0/0 Epoch=2 Accuracy=93.50" in out


def test_call_jax():
    import jax.numpy as jnp

    from torchacc import metrics
    from torchacc.torch_xla.core import xla_builder as xb

    a = torch.arange(4.0, device=torchacc.device()) + 1
    calls = metrics.counter_value("CallJax") or 0
    out = xb.call_jax(lambda x, y: (jnp.sin(x) * y, x.sum()), (a, 2.0))
    assert metrics.counter_value("CallJax") == calls + 2  # one per JAX array handed back
    torch.testing.assert_close(out[0].cpu(), torch.sin(torch.arange(4.0) + 1) * 2)
    assert out[1].cpu().item() == 10.0 and out[0].device.type == "torchacc"
    with pytest.raises(NotImplementedError, match="call_jax"):
        xb.create_computation("f", None, [])


# --- xla:// rendezvous ----------------------------------------------------------------------------


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


WORKER = "tests/torch_xla_rendezvous_worker.py"


@pytest.mark.slow
def test_xla_init_method_one_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torchacc.run_torch_xla", WORKER, str(tmp_path / "r")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "r.0.json").read_text())
    assert out == {
        "rank": 0,
        "world": 1,
        "sum": [1.0, 1.0],
        "process": [0, 1],
        "payloads": ["from 0"],
        "saved": [1.0, 1.0],
    }


@pytest.mark.slow
def test_xla_init_method_two_processes_under_torchrun(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed_launch import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "torchacc.run_torch_xla",
        WORKER,
        str(tmp_path / "r"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"r.{rank}.json").read_text())
        # every rank gets every rank's payload, in rank order; the file xm.save wrote (rank 0
        # only) is complete when any rank passes the save's rendezvous
        assert out == {
            "rank": rank,
            "world": 2,
            "sum": [3.0, 3.0],
            "process": [rank, 2],
            "payloads": ["from 0", "from 1"],
            "saved": [3.0, 3.0],
        }


def test_one_process_replica_groups():
    """One process: groups naming only replica 0 are the whole world; a group of two is an error
    naming the groups (all_reduce, all_gather and reduce_scatter alike)."""
    import torchacc.torch_xla.core.xla_model as xm

    x = torch.arange(4.0).to(torchacc.device())
    torch.testing.assert_close(xm.all_reduce("sum", x, groups=[[0]]).cpu(), x.cpu())
    torch.testing.assert_close(xm.all_gather(x, groups=[[0]]).cpu(), x.cpu())
    with pytest.raises(ValueError, match=r"replica groups \[\[0, 1\]\] name more replicas"):
        xm.all_reduce("sum", x, groups=[[0, 1]])
