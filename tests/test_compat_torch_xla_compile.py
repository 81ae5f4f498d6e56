"""torch_xla.compile(f, max_different_graphs=N) (torchacc/torch_xla/_graph_limit.py) and the
profiler server's one-per-process rule (torch_xla.debug.profiler)."""

import pytest
import torch

import torchacc
import torchacc.torch_xla as torch_xla
from torchacc.torch_xla.debug import profiler as xp

DEV = torchacc.device()


def test_max_different_graphs_counts_traces_and_names_the_diverging_op():
    def f(x, mode):
        r = x + x
        if mode == "mul":
            return r * 2
        if mode == "add":
            return r + x
        return r if mode == "short" else r / 3

    g = torch_xla.compile(f, max_different_graphs=2)
    x = torch.ones(4, device=DEV)
    assert g(x, "mul").cpu().tolist() == [4.0] * 4
    assert g(x, "add").cpu().tolist() == [3.0] * 4  # a second graph: allowed
    assert g(x, "mul").cpu().tolist() == [4.0] * 4  # a known trace: no new graph
    add = "[] aten::add, xla_shape=f32[4]{0}, dynamic_dims: ()"
    mul = "[] aten::mul, xla_shape=f32[4]{0}, dynamic_dims: ()"
    with pytest.raises(RuntimeError, match="exceeded: 2\nGot: .*aten::div") as e:
        g(x, "div")
    assert f"Expected either of:\n  - {mul}\n  - {add}\n" in str(e.value)
    with pytest.raises(RuntimeError, match="Reached the end of the function at") as e:
        g(x, "short")
    assert str(e.value).startswith("Maximum number of different graphs allowed per function")
    with pytest.raises(RuntimeError, match=r"Got: .*f32\[2\]\{0\}"):  # another input shape
        g(torch.ones(2, device=DEV), "mul")
    with pytest.raises(ValueError, match="max_different_graphs=0"):
        torch_xla.compile(f, max_different_graphs=0)(x, "mul")


def test_profiler_server_is_started_once_per_process(monkeypatch):
    started = []
    monkeypatch.setattr(xp, "_server", [None, None])
    monkeypatch.setattr(xp.jax.profiler, "start_server", lambda port: started.append(port) or port)
    assert xp.start_server(8005) == 8005
    assert xp.start_server(8005) == 8005  # the same port: the running server
    assert started == [8005]
    with pytest.raises(RuntimeError, match="already runs on port 8005"):
        xp.start_server(8006)


def test_call_jax_is_one_node_of_the_step_and_cached_per_signature():
    import jax.numpy as jnp

    from torchacc.lazy.record import value_of
    from torchacc.program.key import _collect
    from torchacc.torch_xla.core import xla_builder as xb

    def f(inputs, k):
        return {"y": jnp.sin(inputs["a"]) * k + inputs["b"], "s": inputs["a"].sum()}

    xb._JAX_TO_XLA_COMPUTATION_CACHE.clear()
    a = torch.arange(4.0, device=DEV) + 1
    b = a * 3  # pending: traced into the same step, not synced first
    out = xb.call_jax(f, ({"a": a, "b": b}, 2.0))
    order, _ = _collect([value_of(out["y"])])
    assert [n.op.rule.name for n in order][-1] == "torchacc.call_jax.default"
    torchacc.sync()
    ref = torch.arange(4.0) + 1
    torch.testing.assert_close(out["y"].cpu(), torch.sin(ref) * 2 + ref * 3)
    assert out["s"].cpu().item() == 10.0
    xb.call_jax(f, ({"a": a, "b": b}, 2.0))
    assert xb._jax_to_xla_computation_cache_elements() == 1  # same signature: traced once
    xb.call_jax(f, ({"a": a, "b": b}, 3.0))  # another static value
    xb.call_jax(f, ({"a": a[:2], "b": b[:2]}, 2.0))  # another shape
    assert xb._jax_to_xla_computation_cache_elements() == 3
    with pytest.raises(ValueError, match="cpu tensor"):
        xb.call_jax(f, ({"a": a, "b": torch.ones(4)}, 2.0))


def test_call_jax_inside_assume_pure():
    import jax.numpy as jnp

    from torchacc.torch_xla.core import xla_builder as xb
    from torchacc.torch_xla.experimental.assume_pure import assume_pure_torch

    def f(a, b):
        return xb.call_jax(lambda x, y: jnp.dot(x, y), (a, b)) + 1

    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with torch.no_grad():
        out = assume_pure_torch(f)(a.to(DEV), b.to(DEV))
        torchacc.sync()
    torch.testing.assert_close(out.cpu(), a @ b + 1)
