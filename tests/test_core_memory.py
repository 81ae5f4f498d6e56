"""What a user relies on about device memory: donated buffers are really given away, host and
device copies never share memory (every transfer path, both directions), and waiting waits."""

import jax
import numpy as np
import pytest
import torch

import torchacc
import torchacc.torch_xla as torch_xla
import torchacc.torch_xla.core.xla_model as xm
from torchacc.program.pack import buffer_of

DEV = torchacc.device()


def _array(t):
    """The device buffer (jax.Array) behind a torchacc tensor (after its step ran): its own, or
    the pack holding it (Note [Packed state])."""
    return buffer_of(t._st.value)


# ------------------------------------------------------------------------------------------------
# donation


@pytest.mark.parametrize("pack_max", ["0", "default"])
def test_updated_parameters_give_their_buffers_to_the_new_values(monkeypatch, pack_max):
    """An optimizer step overwrites parameters in place: XLA must reuse their buffers (donation),
    or device memory holds every parameter twice while the step runs. JAX marks a donated input
    array deleted once the program has taken it. With packing (Note [Packed state]) the small
    parameters live in one pack per dtype, and the pack is donated. A step whose state differs
    from the step before (the first: uploaded parameters; the second: SGD's momentum appears)
    first gathers its state into a pack laid out like its results (the program reads it as
    later steps will), so the older buffers are dropped there, not donated."""
    if pack_max == "0":
        monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", "0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 8).to(DEV)
    for step in range(3):
        torchacc.sync(wait=True)
        before = [_array(p) for p in model.parameters()]
        assert not any(a.is_deleted() for a in before)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync(wait=True)
        donated = [a.is_deleted() for a in before]
        if pack_max == "0" or step == 2:
            assert all(donated), f"step {step}: parameter buffers donated: {donated}"
        after = {id(_array(p)) for p in model.parameters()}
        assert len(after) == (4 if pack_max == "0" else 1), "one pack holds them all"
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    old = [_array(m) for m in momentum]
    model(x).square().mean().backward()
    opt.step()
    torchacc.sync(wait=True)
    assert all(a.is_deleted() for a in old), "optimizer state is donated too"


def test_a_buffer_still_held_by_a_tensor_is_not_donated():
    """Donating a buffer that a live tensor still reads would corrupt that tensor."""
    w = torch.arange(6.0).to(DEV)
    torchacc.sync(wait=True)
    snapshot = w.detach()  # shares the storage: the same buffer, still wanted after the step
    alias_free = w.clone()
    torchacc.sync(wait=True)
    kept = _array(alias_free)
    w.mul_(2)
    torchacc.sync(wait=True)
    assert snapshot.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # a view sees the write
    assert alias_free.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert not kept.is_deleted()


# ------------------------------------------------------------------------------------------------
# host <-> device isolation

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def _host(dtype):
    t = torch.arange(6).reshape(2, 3)
    return (t % 2).bool() if dtype == torch.bool else t.to(dtype)


def _fill(dtype):
    return True if dtype == torch.bool else 100


def _to_device_paths():
    """Every way host data reaches the device: name -> (host tensor, fn(host) -> device tensor).
    The functions take a CPU tensor; numpy-based paths share memory with it through .numpy()."""
    return {
        "to(dev)": lambda h: h.to(DEV),
        "to(device=, dtype=)": lambda h: h.to(device=DEV, dtype=h.dtype),
        "copy_": lambda h: torch.empty(h.shape, dtype=h.dtype, device=DEV).copy_(h),
        "copy_ into a view": lambda h: _copy_into_view(h),
        "torch.tensor(numpy, device=)": lambda h: torch.tensor(h.numpy(), device=DEV),
        "torch.as_tensor(tensor, device=)": lambda h: torch.as_tensor(h, device=DEV),
        "torch.as_tensor(numpy, device=)": lambda h: torch.as_tensor(h.numpy(), device=DEV),
        "torch.asarray(tensor, device=)": lambda h: torch.asarray(h, device=DEV),
        "from_numpy().to(dev)": lambda h: torch.from_numpy(h.numpy()).to(DEV),
        "zeros_like(device=) + copy_": lambda h: torch.zeros_like(h, device=DEV).copy_(h),
        "non-contiguous .to(dev)": lambda h: h.t().to(DEV).t(),
    }


def _copy_into_view(h):
    big = torch.zeros((4, *h.shape[1:]), dtype=h.dtype, device=DEV)
    big[1:3].copy_(h)
    return big[1:3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(_to_device_paths()))
def test_host_to_device_copies_are_isolated(path, dtype):
    if dtype == torch.bfloat16 and "numpy" in path:
        pytest.skip("numpy has no bfloat16")
    host = _host(dtype)
    want = host.clone()
    dev = _to_device_paths()[path](host)
    assert dev.device == DEV
    host.fill_(_fill(dtype))  # the user reuses the host buffer (a pinned batch, a numpy array)
    assert torch.equal(dev.cpu(), want), f"{path}: a later host write reached the device"
    host.copy_(want)
    dev.fill_(_fill(dtype))  # and writes on the device (donated, step run) ...
    torchacc.sync(wait=True)
    assert torch.equal(host, want), f"{path}: a device write reached the host tensor"


def _from_device_paths():
    """Every way device data reaches the host: name -> fn(device tensor) -> host object, and
    the function that mutates that host object in place."""
    return {
        "cpu()": (lambda d: d.cpu(), lambda h, v: h.fill_(v)),
        "to('cpu')": (lambda d: d.to("cpu"), lambda h, v: h.fill_(v)),
        "to(cpu, dtype)": (lambda d: d.to("cpu", d.dtype), lambda h, v: h.fill_(v)),
        "detach().cpu()": (lambda d: d.detach().cpu(), lambda h, v: h.fill_(v)),
        "numpy()": (lambda d: d.numpy(), _np_fill),
        "cpu().numpy()": (lambda d: d.cpu().numpy(), _np_fill),
        "tolist()": (lambda d: d.tolist(), _list_fill),
        "copy_ into a CPU tensor": (lambda d: torch.empty(d.shape, dtype=d.dtype).copy_(d), None),
    }


def _np_fill(a, v):
    a[...] = v


def _list_fill(lst, v):
    lst[0][0] = v


def _normalize(x):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, list):
        return torch.tensor(x)
    return x.clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", list(_from_device_paths()))
def test_device_to_host_copies_are_isolated(path, dtype):
    if dtype == torch.bfloat16 and "numpy" in path:
        pytest.skip("numpy has no bfloat16")
    get, mutate = _from_device_paths()[path]
    want = _host(dtype)
    dev = want.to(DEV)
    torchacc.sync(wait=True)
    host = get(dev)
    first = _normalize(host)
    assert torch.equal(first.to(want.dtype), want)
    again = get(dev)  # a second read is another copy
    if mutate is None:
        mutate = lambda h, v: h.fill_(v)  # noqa: E731
    mutate(host, _fill(dtype))
    assert torch.equal(dev.cpu(), want), f"{path}: writing the host copy changed the device"
    assert torch.equal(_normalize(again).to(want.dtype), want), f"{path}: two reads share memory"
    snap = _normalize(host)
    dev.fill_(0)  # a device write, donated and run
    dev.add_(dev)
    torchacc.sync(wait=True)
    assert torch.equal(_normalize(host), snap), f"{path}: a device write reached the host copy"


def test_device_to_device_copy_is_not_an_alias():
    a = torch.arange(4.0).to(DEV)
    b = torch.empty(4, device=DEV)
    b.copy_(a)
    c = a.clone()
    a.fill_(-1.0)
    torchacc.sync(wait=True)
    assert b.cpu().tolist() == c.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------------------------------------------------------
# waiting


def _heavy_step():
    """A step that runs ~0.1-0.5 s on the CPU backend, so it is still running when sync()
    returns (sync launches asynchronously)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(512, 512, generator=g) / 23).to(DEV)
    for _ in range(16):
        x = torch.tanh(x @ x)
    return x


WAITS = {
    "torchacc.wait_device_ops": torchacc.wait_device_ops,
    "torchacc.sync(wait=True)": lambda: torchacc.sync(wait=True),
    "xm.wait_device_ops": xm.wait_device_ops,
    "xm.mark_step(wait=True)": lambda: xm.mark_step(wait=True),
    "torch_xla.sync(wait=True)": lambda: torch_xla.sync(wait=True),
}


def _busy():
    return [a.shape for a in jax.live_arrays() if not a.is_ready()]


@pytest.mark.parametrize("wait", list(WAITS))
def test_sync_returns_at_once_and_waiting_waits(wait):
    for _ in range(2):  # compile, and the first cached step (which also freezes the GC)
        done = _heavy_step()
        torchacc.sync()
        done.cpu()  # reading waits, whatever the wait functions do
    x = _heavy_step()
    torchacc.sync()
    assert _busy(), "sync() waited for the step (it should launch it and return)"
    WAITS[wait]()  # nothing new is pending: this waits for the step already launched
    assert not _busy(), f"{wait} returned while buffers {_busy()} were still being computed"
    assert torch.isfinite(x.cpu()).all()


def _extremes(dtype):
    """The values a dtype's edge cases live at (its bit patterns are compared, so NaN and -0.0
    count too)."""
    if dtype.is_floating_point:
        fi = torch.finfo(dtype)
        return torch.tensor(
            [fi.min, fi.max, -0.0, float("inf"), float("nan"), fi.tiny], dtype=dtype
        )
    if dtype == torch.bool:
        return torch.tensor([True, False])
    if dtype.is_complex:
        return torch.tensor([1 + 2j, complex(-0.0, float("inf"))], dtype=dtype)
    ii = torch.iinfo(dtype)
    return torch.tensor([ii.min, ii.max, 0, 1], dtype=dtype)


ROUND_TRIP_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
]  # fmt: skip


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_host_device_round_trip_is_bit_exact(dtype):
    """Every dtype's extremes come back from the device with the same dtype and bits (uint32
    and bfloat16 have no direct numpy view in torch; they travel through an integer view)."""
    host = _extremes(dtype)
    back = host.to(DEV).cpu()
    assert back.dtype == dtype
    raw = (lambda t: t) if dtype == torch.bool else (lambda t: t.view(torch.uint8))
    assert torch.equal(raw(back), raw(host)), (host, back)
