"""torchacc.torch_xla: xla_model (xm), the top level, runtime, debug.metrics and utils."""

import torch
import torch.nn as nn

import torchacc
import torchacc.torch_xla as torch_xla
import torchacc.torch_xla.core.xla_model as xm
import torchacc.torch_xla.debug.metrics as met
import torchacc.torch_xla.runtime as xr
import torchacc.torch_xla.utils.utils as xu
from torchacc.torch_xla.core import _xm_devices
from torchacc.torch_xla.distributed import xla_multiprocessing as xmp


def test_devices_and_ranks():
    dev = xm.xla_device()
    assert dev == torchacc.device() == torch_xla.device() == torch_xla.devices()[0]
    assert xm.xla_device_hw(dev) in ("GPU", "CPU")
    assert xm.xla_device_hw("xla:0") == xm.xla_device_hw(dev)
    assert (xm.get_ordinal(), xm.get_local_ordinal(), xm.xrt_world_size()) == (0, 0, 1)
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)
    assert (xr.world_size(), xr.global_ordinal(), xr.local_ordinal()) == (1, 0, 0)
    assert xr.device_type() in ("CUDA", "CPU")
    assert xm.is_xla_tensor(torch.ones(2).to(dev)) and not xm.is_xla_tensor(torch.ones(2))
    xm.set_replication(dev, [dev])
    assert xm.get_replication_devices() == [dev]


def test_world_info_reads_the_launcher_environment(monkeypatch):
    torchacc.jax_device()  # this process's device first: the variables below are pretend ones
    monkeypatch.setattr(
        _xm_devices,
        "_modules",
        {"torchacc.distributed": None, "torchacc.distributed.collectives": None},
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert xm.world_info() == (3, 4, 1, 2)
    assert not xm.is_master_ordinal() and not xm.is_master_ordinal(local=False)
    t = torch.ones(2).to(torchacc.device())
    try:
        xm.all_reduce("sum", [t])
    except NotImplementedError as e:
        assert "all_reduce" in str(e)
    else:
        raise AssertionError("expected NotImplementedError without torchacc.distributed")


def test_all_reduce_single_process():
    dev = torchacc.device()
    a = torch.tensor([1.0, 2.0]).to(dev)
    b = torch.tensor([3.0]).to(dev)
    out = xm.all_reduce(xm.REDUCE_SUM, a, scale=0.5)
    assert out is not a and out.cpu().tolist() == [0.5, 1.0]
    assert xm.all_reduce("max", a).cpu().tolist() == [1.0, 2.0]
    lst = [a, b]
    assert xm.all_reduce("sum", lst, scale=2.0) is lst  # in place for lists
    assert a.cpu().tolist() == [2.0, 4.0] and b.cpu().tolist() == [6.0]
    try:
        xm.all_reduce("median", a)
    except ValueError:
        pass
    else:
        raise AssertionError("bad reduce type accepted")
    assert xm.all_gather(a).cpu().tolist() == [2.0, 4.0]
    out = torch.zeros(2).to(dev)
    assert xm.all_gather(a, output=out) is out and out.cpu().tolist() == [2.0, 4.0]
    assert xm.reduce_scatter("sum", a, 0.5, 0, 1).cpu().tolist() == [1.0, 2.0]
    assert xm.all_to_all(a, 0, 0, 1).cpu().tolist() == [2.0, 4.0]
    assert xm.rendezvous("tag", b"x") == [b"x"]
    assert xm.mesh_reduce("acc", torch.tensor(3.0).to(dev), lambda xs: sum(xs)).item() == 3.0
    assert xm.mesh_reduce("n", 5, max) == 5


def test_gradients_reduce_and_optimizer_step():
    dev = torchacc.device()
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert xm._fetch_gradients(opt) == []
    model(torch.ones(4, 3).to(dev)).sum().backward()
    grads = xm._fetch_gradients(opt)
    assert len(grads) == 2 and all(g.device.type == "torchacc" for g in grads)
    xm.all_reduce("sum", grads, scale=0.5)  # in place: the optimizer sees it
    assert model.bias.grad.cpu().tolist() == [2.0, 2.0]
    before = model.bias.detach().cpu().clone()
    xm.optimizer_step(opt, barrier=True)
    torch.testing.assert_close(model.bias.detach().cpu(), before - 0.1 * 2.0)
    xm.reduce_gradients(opt)


def test_mark_step_closures_and_metrics(tmp_path):
    dev = torchacc.device()
    met.clear_all()
    seen = []
    x = torch.ones(3).to(dev) * 2
    xm.add_step_closure(lambda t, tag: seen.append((tag, t.cpu().tolist())), args=(x, "a"))
    assert seen == []
    xm.mark_step()
    assert seen == [("a", [2.0, 2.0, 2.0])]
    torch_xla.sync(wait=True)
    xm.wait_device_ops()
    assert met.counter_value("MarkStep") == 2
    assert "MarkStep" in met.counter_names()
    assert "MarkStep" in met.metrics_report() and "MarkStep" in met.short_metrics_report()
    assert isinstance(met.metric_names(), list)
    assert met.executed_fallback_ops() == [n for n in met.counter_names() if n.startswith("aten::")]
    met.clear_all()
    assert met.counter_value("MarkStep") is None
    info = xm.get_memory_info(dev)
    assert info["bytes_limit"] > 0 and info["kb_total"] > 0
    with torch_xla.step():
        y = x + 1
    assert y.cpu().tolist() == [3.0, 3.0, 3.0]


def test_save(tmp_path):
    dev = torchacc.device()
    model = nn.Linear(2, 2)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(dev)
    path = tmp_path / "ckpt.pt"
    xm.save({"model": model.state_dict(), "step": 3, "list": [torch.ones(1).to(dev)]}, path)
    loaded = torch.load(path)
    assert loaded["step"] == 3 and loaded["list"][0].device.type == "cpu"
    for k, v in ref.items():
        assert loaded["model"][k].device.type == "cpu"
        torch.testing.assert_close(loaded["model"][k], v)
    xm.save({"x": 1}, tmp_path / "other.pt", master_only=False)
    assert (tmp_path / "other.pt").exists()


def test_runtime_cache_and_utils(tmp_path):
    assert xr.initialize_cache(str(tmp_path / "cache")) == str(tmp_path / "cache")
    import os

    from torchacc import program as _compile

    _compile.enable_persistent_cache(os.environ["TORCHACC_CACHE_DIR"])
    gen = xu.SampleGenerator(data=(1, 2), sample_count=3)
    assert len(gen) == 3 and list(gen) == [(1, 2)] * 3 and list(gen) == [(1, 2)] * 3
    assert xmp.spawn(lambda index, v: (index, v), args=(7,)) == (0, 7)
