"""Device API, host reads, factories, RNG, fallbacks, metrics and the compile caches."""

import copy
import os
import sys
import textwrap

import prewarmed
import pytest
import torch
from compile_counts import new_graphs

import torchacc
from torchacc import metrics
from torchacc.program.pack import buffer_of

DEV = torchacc.device()


def test_device_identity():
    x = torch.ones(2).to(DEV)
    assert x.device == DEV and x.device.type == "torchacc"
    assert torchacc.device_hw() in ("CPU", "GPU")
    with pytest.raises(ValueError, match="index must be 0"):
        torchacc.device(3)


def test_factories_on_device():
    torch.manual_seed(0)
    cases = {
        "empty": torch.empty(2, 3, device=DEV).shape,
        "zeros": torch.zeros(2, 3, device=DEV).cpu(),
        "ones": torch.ones(2, 3, dtype=torch.bfloat16, device=DEV).cpu(),
        "full": torch.full((2,), 7, device=DEV).cpu(),
        "arange": torch.arange(1, 10, 2, device=DEV).cpu(),
        "tensor": torch.tensor([[1, 2], [3, 4]], device=DEV).cpu(),
        "zeros_like": torch.zeros_like(torch.ones(3).to(DEV)).cpu(),
        "full_like": torch.full_like(torch.ones(3).to(DEV), 2.5).cpu(),
    }
    assert cases["empty"] == (2, 3)
    assert cases["zeros"].equal(torch.zeros(2, 3))
    assert cases["ones"].dtype == torch.bfloat16 and cases["ones"].float().sum() == 6
    assert cases["full"].equal(torch.full((2,), 7))
    assert cases["arange"].equal(torch.arange(1, 10, 2))
    assert cases["tensor"].equal(torch.tensor([[1, 2], [3, 4]]))
    assert cases["zeros_like"].equal(torch.zeros(3))
    assert cases["full_like"].equal(torch.full((3,), 2.5))
    r = torch.rand(1000, device=DEV).cpu()
    n = torch.randn(1000, device=DEV).cpu()
    i = torch.randint(3, 7, (1000,), device=DEV).cpu()
    assert 0 <= r.min() and r.max() < 1 and abs(r.mean() - 0.5) < 0.05
    assert abs(n.mean()) < 0.15 and abs(n.std() - 1) < 0.15
    assert i.dtype == torch.int64 and i.min() == 3 and i.max() == 6


def test_host_reads_count_transfers():
    x = torch.arange(6.0).to(DEV).view(2, 3)
    metrics.clear_all()
    y = x * 2
    assert y.sum().item() == 30.0
    assert metrics.counter_value("TransferFromDevice") == 1
    assert y.tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    assert (y.numpy() == (torch.arange(6.0).view(2, 3) * 2).numpy()).all()
    assert "device='torchacc:0'" in repr(y)
    assert bool((y > 9).any()) is True
    if y.max() > 5:
        pass
    assert metrics.counter_value("TransferFromDevice") == 6


def test_reading_runs_only_what_it_needs():
    x = torch.ones(3).to(DEV)
    a = x + 1
    b = x * 5  # pending, not needed by a.item()
    metrics.clear_all()
    assert a.sum().item() == 6
    assert b._st.value.node is not None  # still pending
    torchacc.sync()
    assert b._st.value.node is None and b.cpu().tolist() == [5.0] * 3


def test_rng_steps_differ_and_runs_reproduce():
    def run():
        torch.manual_seed(1234)
        drop = torch.nn.Dropout(0.5)
        x = torch.ones(64).to(DEV)
        first = drop(x)
        torchacc.sync()
        second = drop(x)
        return first.cpu(), second.cpu()

    a1, a2 = run()
    b1, b2 = run()
    assert not a1.equal(a2)
    assert a1.equal(b1) and a2.equal(b2)
    assert set(a1.unique().tolist()) <= {0.0, 2.0}


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63, 2**63 - 1, -5])
def test_rng_takes_every_torch_seed(seed):
    # torch's default seed (no manual_seed) is a random unsigned 64-bit number
    torch.manual_seed(seed)
    first = torch.rand(8, device=DEV).cpu()
    torch.manual_seed(seed)
    assert first.equal(torch.rand(8, device=DEV).cpu())
    torch.manual_seed(7)
    assert not first.equal(torch.rand(8, device=DEV).cpu())


@pytest.mark.parametrize("shape", [(3, 4), (2, 0, 3), (1, 5, 1), (), (7,)])
def test_uploaded_tensors_have_eagers_strides(shape):
    """A tensor moved to the device, or deep-copied there (EMA models, ``copy.deepcopy``), is
    contiguous with eager's strides (size-0 and size-1 dims included), so stride-dependent code
    (``view``, ``is_contiguous``) behaves as on CPU."""
    host = torch.randn(shape)
    t = host.to(DEV)
    for u in (t, copy.deepcopy(t)):
        assert u.stride() == host.stride() and u.is_contiguous() and u.storage_offset() == 0
    torch.testing.assert_close(t.view(-1).cpu(), host.view(-1))
    if t.dim() >= 2:
        assert t.transpose(0, 1).contiguous().stride() == host.transpose(0, 1).contiguous().stride()


def test_scalar_values_do_not_recompile():
    x = torch.ones(4).to(DEV)
    torchacc.sync()
    metrics.clear_all()
    for lr in (0.1, 0.01, 0.001, 0.5):
        x.add_(x * lr, alpha=-lr)
        torchacc.sync()
    assert new_graphs() == 1
    assert metrics.counter_value("CachedCompile") == 3
    want = torch.ones(4)
    for lr in (0.1, 0.01, 0.001, 0.5):
        want.add_(want * lr, alpha=-lr)
    torch.testing.assert_close(x.cpu(), want)


def test_sync_is_async_and_wait_blocks():
    x = torch.randn(64, 64).to(DEV)
    for _ in range(3):
        x = x @ x / 64
    torchacc.sync()
    torchacc.sync(wait=True)
    assert torch.isfinite(x.cpu()).all()


def test_parameters_are_donated():
    lin = torch.nn.Linear(4, 4).to(DEV)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for _ in range(2):
        torchacc.sync()
        old = lin.weight._st.value
        assert old.array is not None
        lin(torch.ones(2, 4).to(DEV)).sum().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        # the previous weight buffer (or the pack holding it) was handed to the new one
        assert old.array is None and buffer_of(old) is None


def test_fallback_counts_and_warns(monkeypatch):
    from torchacc.lazy import fallback

    monkeypatch.setattr(fallback, "_warned", set())  # warned once per process: not yet here
    x = torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0, 1.0]).to(DEV)
    metrics.clear_all()
    with pytest.warns(UserWarning, match="aten.unique_consecutive"):  # (data-dependent shape)
        v = torch.unique_consecutive(x)
    assert v.device == DEV and v.cpu().tolist() == [1.0, 2.0, 3.0, 1.0]
    assert metrics.counter_value("aten::unique_consecutive") == 1
    assert "aten::unique_consecutive" in metrics.executed_fallback_ops()


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("TORCHACC_STRICT", "1")
    x = torch.randn(7).to(DEV)
    with pytest.raises(RuntimeError, match="aten.unique_consecutive"):
        torch.unique_consecutive(x)


def test_resize_to_the_same_shape_is_a_no_op_and_a_new_shape_a_clear_error():
    x = torch.arange(6.0).reshape(2, 3).to(DEV)
    before = dict((n, metrics.counter_value(n)) for n in metrics.executed_fallback_ops())
    assert x.resize_as_(torch.empty(2, 3)) is x and x.resize_(2, 3) is x
    assert dict((n, metrics.counter_value(n)) for n in metrics.executed_fallback_ops()) == before
    with pytest.raises(RuntimeError, match=r"resize_.*from \(2, 3\) to \(6,\)"):
        x.resize_(6)
    assert x.shape == (2, 3) and x.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_mixing_devices_is_a_clear_error():
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3).to(DEV) + torch.ones(3)


def test_state_dict_roundtrip(tmp_path):
    model = torch.nn.Linear(3, 2).to(DEV)
    path = tmp_path / "m.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path)
    assert loaded["weight"].device.type == "cpu"
    fresh = torch.nn.Linear(3, 2).to(DEV)
    fresh.load_state_dict(loaded)
    torch.testing.assert_close(fresh.weight.cpu(), model.weight.cpu())


def test_hooks_and_custom_function():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = torch.arange(4.0).to(DEV).requires_grad_()
    seen = []
    x.register_hook(lambda g: seen.append(g) or g * 10)
    Square.apply(x).sum().backward()
    assert x.grad.cpu().tolist() == [0.0, 20.0, 40.0, 60.0]
    assert seen[0].cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


_SCRIPT = textwrap.dedent("""
    import torch, torchacc
    from torchacc import metrics
    x = torch.arange(12.0).to(torchacc.device()).view(3, 4)
    y = (x * 2 + 1).sum(0)
    print("RESULT", y.cpu().tolist(), metrics.counter_value("UncachedCompile"),
          metrics.counter_value("PersistentCacheHit"))
""")


def _run_script(env, script=_SCRIPT):
    out = prewarmed.run(["-c", script], env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_persistent_cache_survives_restart(tmp_path):
    env = dict(
        os.environ,
        TORCHACC_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    first = _run_script(env).stdout.split("RESULT")[1].split()
    second = _run_script(env).stdout.split("RESULT")[1].split()
    assert first[-2] != "None" and first[-1] == "None"  # compiled, no hit
    assert second[-2] == "None" and second[-1] != "None"  # nothing compiled, all from disk


def test_heap_is_trimmed_only_after_a_long_uncached_compile(monkeypatch):
    """Note [Giving a compile's memory back]: ``malloc_trim`` walks the whole C heap, so it runs
    after a compile of at least TRIM_AFTER_COMPILE_S that missed the persistent cache, never after
    a small one."""
    from torchacc.program import cache

    trims = []
    monkeypatch.setattr(cache, "release_freed_memory", lambda: trims.append(1))
    x = torch.arange(6.0).to(DEV)
    monkeypatch.setattr(cache, "TRIM_AFTER_COMPILE_S", 1e9)
    assert (x * 3.5 + 0.25).cpu().tolist() == [(v * 3.5 + 0.25) for v in range(6)]
    assert trims == []  # compiled (a new program), but not for long
    monkeypatch.setattr(cache, "TRIM_AFTER_COMPILE_S", 0.0)
    uncached = metrics.counter_value("UncachedCompile") or 0
    assert (x * 4.5 - 0.75).cpu().tolist() == [(v * 4.5 - 0.75) for v in range(6)]
    missed = (metrics.counter_value("UncachedCompile") or 0) - uncached
    assert trims == [1] * missed  # a program loaded from the persistent cache frees nothing


def test_step_graph_is_freed_by_reference_counting():
    """Values point at nodes, never back: a step's graph needs no cycle collector."""
    import gc

    from torchacc.ir import Node, Value

    def count():
        return sum(type(o) in (Node, Value) for o in gc.get_objects())

    w = torch.randn(8, 8).to(DEV).requires_grad_()
    torchacc.sync(wait=True)
    gc.collect()
    gc.disable()
    try:
        before = count()
        for _ in range(3):
            loss = torch.tanh(w @ w).sum()
            loss.backward()
            with torch.no_grad():
                w.sub_(0.1 * w.grad)
            w.grad = None
            torchacc.sync()
        del loss
        assert count() <= before + 2  # w's and the RNG's current Values may have moved
    finally:
        gc.enable()


# Frozen = the permanent generation grew since before the first step: an import (a CUDA or
# plugin build of torch/JAX) may already have frozen objects of its own before any sync.
_GC_SCRIPT = textwrap.dedent("""
    import gc, torch, torchacc
    w = torch.ones(4).to(torchacc.device())
    base = gc.get_freeze_count()
    for step in range(3):
        w.add_(1.0)
        torchacc.sync()
        print("FROZEN", step, gc.get_freeze_count() > base)
    young = []
    for step in range(4):  # a step allocating ~3,000 objects (held until the sync)
        parts = [w * float(i) for i in range(300)]
        torchacc.sync()
        del parts
        if step == 0:  # compiled: count the cached steps' collections
            gc.callbacks.append(lambda phase, info: phase == "start" and young.append(info))
    print("THRESHOLD", gc.get_threshold()[0], "COLLECTIONS", len(young))
""")


@pytest.mark.parametrize("setting", ["", "0"])
def test_gc_freeze_after_first_cached_step(setting):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TORCHACC_GC_FREEZE", None)
    if setting:
        env["TORCHACC_GC_FREEZE"] = setting
    out = _run_script(env, _GC_SCRIPT)
    frozen = [ln.endswith("True") for ln in out.stdout.splitlines() if "FROZEN" in ln]
    # step 0 compiles, step 1 reuses the executable: freeze then (unless turned off)
    want = [False, True, True] if not setting else [False, False, False]
    assert frozen == want, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-3000:]}"
    threshold, collections = out.stdout.split("THRESHOLD")[1].split()[::2]
    if setting:  # Python's defaults: young collections every 700 net allocations
        assert threshold == "700" and int(collections) > 0
    else:  # raised at the freeze: a cached step of ~3,000 live objects runs no collection
        assert threshold == "10000" and collections == "0"


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**32 + 5, 2**63 - 1, 2**63, 2**64 - 1, -5])
def test_host_computed_key_matches_jax(seed):
    import jax
    import numpy as np

    from torchacc.runtime.rng import key_data

    signed = seed & (2**64 - 1)
    signed = signed - 2**64 if signed >= 2**63 else signed
    want = np.asarray(jax.random.key_data(jax.random.key(signed)))
    np.testing.assert_array_equal(key_data(seed), want)


def test_gc_refreeze_collects_cycles_that_were_frozen(monkeypatch):
    import gc
    import weakref

    from torchacc.engine import execute

    class Cycle:
        pass

    obj = Cycle()
    obj.me = obj
    probe = weakref.ref(obj)
    gc.collect()
    gc.freeze()  # as torchacc does at the first cached sync
    del obj
    gc.collect()
    assert probe() is not None  # frozen: the collector does not look at it
    monkeypatch.setattr(execute, "GC_REFREEZE_EVERY", 1)
    monkeypatch.setattr(execute, "_gc_frozen", [True])
    torchacc.sync()
    assert probe() is None  # the re-freeze collected it
    assert gc.get_freeze_count() > 0  # and froze again


_DEVICE_SCRIPT = textwrap.dedent("""
    import torch, torchacc
    y = torch.arange(4.0).to(torchacc.device()) * 2
    torchacc.sync(wait=True)
    (buf,) = y._st.value.array.devices()
    print("RESULT", torchacc.platform(), torchacc.device_hw(), buf.platform, y.cpu().tolist())
""")


@pytest.mark.parametrize("value", ["cpu", "CPU"])
def test_torchacc_device_forces_the_platform(value):
    """TORCHACC_DEVICE=cpu computes on JAX's CPU device even where JAX sees a GPU."""
    env = dict(os.environ, TORCHACC_DEVICE=value, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("JAX_PLATFORMS", None)  # nothing else narrows JAX's platforms
    line = _run_script(env, _DEVICE_SCRIPT).stdout.split("RESULT")[1].split(None, 3)
    assert line[:3] == ["cpu", "CPU", "cpu"] and line[3].strip() == "[0.0, 2.0, 4.0, 6.0]"


@pytest.fixture
def fresh_device_choice():
    from torchacc.runtime import device

    device.platform.cache_clear()
    device.jax_device.cache_clear()
    yield device
    device.platform.cache_clear()
    device.jax_device.cache_clear()


def test_torchacc_device_bad_values_name_the_variable(monkeypatch, fresh_device_choice):
    monkeypatch.setenv("TORCHACC_DEVICE", "tpu")
    with pytest.raises(ValueError, match="TORCHACC_DEVICE='tpu': expected 'gpu', 'cuda' or 'cpu'"):
        fresh_device_choice.platform()
    import jax

    try:
        has_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        has_gpu = False
    if has_gpu:
        return
    for value in ("gpu", "cuda"):
        fresh_device_choice.platform.cache_clear()
        monkeypatch.setenv("TORCHACC_DEVICE", value)
        with pytest.raises(RuntimeError, match=f"TORCHACC_DEVICE='{value}' asks for a gpu device"):
            fresh_device_choice.jax_device()


def test_gc_collects_once_at_the_freeze_and_every_refreeze_steps_after(monkeypatch):
    """Note [Garbage collection]: the first cached sync runs one full collection (garbage cycles
    alive then are freed, not frozen) and freezes; later syncs run none until the
    ``GC_REFREEZE_EVERY``-th, which collects and freezes again."""
    import gc
    import weakref

    from torchacc.engine import execute

    class Cycle:
        pass

    w = torch.ones(4).to(DEV)
    w.add_(1.0)
    torchacc.sync()  # compiles; the same step again is an in-memory cache hit
    monkeypatch.setattr(execute, "_gc_frozen", [False])
    monkeypatch.setattr(execute, "_syncs_since_freeze", [0])
    monkeypatch.setattr(execute, "GC_REFREEZE_EVERY", 3)
    full = []

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.disable()  # only torchacc's own collections happen below
    gc.callbacks.append(on_gc)
    try:
        cycle = Cycle()
        cycle.me = cycle
        probe = weakref.ref(cycle)
        del cycle
        w.add_(1.0)
        torchacc.sync()
        assert probe() is None, "the freeze kept a garbage cycle alive"
        assert len(full) == 1
        for _ in range(6):
            w.add_(1.0)
            torchacc.sync()
        assert len(full) == 3, f"{len(full)} full collections in 7 syncs (want 1 + 2 re-freezes)"
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
    assert w.cpu().tolist() == [9.0] * 4
