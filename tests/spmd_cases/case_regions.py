"""Manual regions on 4 CPU devices (run by tests/test_sharding_regions.py, CPU_NUM_DEVICES=4).

torch_xla's ``custom_kernel._shard_map`` / ``xs.shard_map`` with ``xm`` collectives inside:
psum, all_gather, a ppermute ring, reduce_scatter, sub-groups; results against eager PyTorch
computed block by block; one program per step (no new program after step 2); bad input.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from compile_counts import new_graphs  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.core.xla_model as xm  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.torch_xla.experimental.custom_kernel import _shard_map  # noqa: E402

xr.use_spmd()
DEV = torchacc.device()
MESH = xs.Mesh(list(range(4)), (4,), ("x",))


def _blocks(t, n=4):
    return list(t.chunk(n, 0))


def _data(seed=0, shape=(8, 3)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def test_psum_all_gather_and_ring_match_eager():
    def body(a):
        s = xm.all_reduce(xm.REDUCE_SUM, a)
        g = xm.all_gather(a, dim=0)
        ring = xm.collective_permute(a, [(i, (i + 1) % 4) for i in range(4)])
        return s * 2.0, g, ring

    f = _shard_map(body, MESH, (("x", None),), (("x", None), ("x", None), ("x", None)))
    x = _data()
    s, g, ring = f(x.to(DEV))
    blocks = _blocks(x)
    want_s = torch.cat([sum(blocks) * 2.0] * 4)
    want_g = torch.cat([x] * 4)
    want_ring = torch.cat([blocks[(i - 1) % 4] for i in range(4)])
    torch.testing.assert_close(s.cpu(), want_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.cpu(), want_g, atol=0, rtol=0)
    torch.testing.assert_close(ring.cpu(), want_ring, atol=0, rtol=0)


def test_reduce_scatter_groups_and_closures():
    w = torch.arange(3.0).to(DEV)  # closed over: a replicated argument of the region

    def body(a):
        rs = xm.reduce_scatter(xm.REDUCE_SUM, a, 1.0, 0, 4)  # (2, 3) -> (1 ... ) per block
        pair = xm.all_reduce(xm.REDUCE_SUM, a, groups=[[0, 1], [2, 3]])
        return rs + w, pair

    x = _data(1, (16, 3))
    rs, pair = xs.shard_map(body, MESH, (("x", None),), (("x", None), ("x", None)))(x.to(DEV))
    blocks = _blocks(x)
    total = sum(blocks)  # (4, 3): member i keeps row i
    torch.testing.assert_close(rs.cpu(), total + torch.arange(3.0), atol=1e-5, rtol=1e-5)
    want_pair = torch.cat([blocks[0] + blocks[1]] * 2 + [blocks[2] + blocks[3]] * 2)
    torch.testing.assert_close(pair.cpu(), want_pair, atol=1e-5, rtol=1e-5)


def test_a_region_in_a_training_step_compiles_once():
    """A region inside a step with a model: the step compiles once (no new program after
    step 2) and the loss equals eager's with the region's math done block by block."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    ref = torch.nn.Linear(3, 3)
    ref.load_state_dict(model.state_dict())
    model = model.to(DEV)

    def norm(a):  # each block divided by the global sum of squares (psum over the region)
        return a / xm.all_reduce(xm.REDUCE_SUM, (a * a).sum()).sqrt()

    region = _shard_map(norm, MESH, (("x", None),), ("x", None))
    graphs, before = [], new_graphs()
    for step in range(4):
        x = _data(10 + step)
        with torch.no_grad():
            y = region(model(x.to(DEV)))
        xm.mark_step()
        graphs.append(new_graphs() - before)
        before += graphs[-1]
        with torch.no_grad():
            r = ref(x)
            want = r / (r * r).sum().sqrt()
        torch.testing.assert_close(y.cpu(), want, atol=1e-5, rtol=1e-5)
    assert graphs[2:] == [0, 0], graphs


def test_bad_input_is_one_value_error():
    x = _data().to(DEV)
    with pytest.raises(ValueError, match="'y'.*not an axis of the mesh"):
        _shard_map(lambda a: a, MESH, (("y", None),), ("x", None))(x)
    with pytest.raises(ValueError, match=r"does not divide a tensor of shape \(6, 3\)"):
        _shard_map(lambda a: a, MESH, (("x", None),), ("x", None))(_data(0, (6, 3)).to(DEV))
    with pytest.raises(ValueError, match="pairs=.*not a permutation"):
        _shard_map(
            lambda a: xm.collective_permute(a, [(0, 1), (1, 1)]), MESH, (("x", None),), ("x", None)
        )(x)
    with pytest.raises(ValueError, match=r"groups=\[\[0, 1\], \[1, 2\]\] do not partition"):
        _shard_map(
            lambda a: xm.all_reduce("sum", a, groups=[[0, 1], [1, 2]]),
            MESH,
            (("x", None),),
            ("x", None),
        )(x)
    # nothing half-applied: a good call still works after the errors
    torch.testing.assert_close(
        _shard_map(lambda a: a * 2, MESH, (("x", None),), ("x", None))(x).cpu(), x.cpu() * 2
    )


def test_enable_and_disable_manual_sharding_match_eager():
    """torch_xla's enable/disable_manual_sharding around ops recorded one by one: the ops between
    run per device (a replicated weight read inside), an xm collective inside runs over the
    mesh; equal to eager block by block; one program from step 2 on."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 3, generator=g)
    wd = w.to(DEV)
    graphs, before = [], new_graphs()
    for step in range(4):
        x = _data(20 + step)
        xd = x.to(DEV)
        block = xs.enable_manual_sharding(xd, ("x", None), mesh=MESH).global_tensor
        assert tuple(block.shape) == (2, 3)
        y = torch.relu(block @ wd) + 1.0
        y = y / xm.all_reduce(xm.REDUCE_SUM, y.sum())
        out = xs.disable_manual_sharding(y, ("x", None), (8, 3), mesh=MESH).global_tensor
        assert tuple(out.shape) == (8, 3)
        xm.mark_step()
        graphs.append(new_graphs() - before)
        before += graphs[-1]
        ys = [torch.relu(b @ w) + 1.0 for b in _blocks(x)]
        total = sum(b.sum() for b in ys)
        torch.testing.assert_close(
            out.cpu(), torch.cat([b / total for b in ys]), atol=1e-5, rtol=1e-5
        )
    assert graphs[2:] == [0, 0], graphs
    block = xs.enable_manual_sharding(wd, (None, None), mesh=MESH).global_tensor
    with pytest.raises(ValueError, match=r"full_shape \(16, 3\).*blocks of shape \(4, 3\)"):
        xs.disable_manual_sharding(block, ("x", None), (16, 3), mesh=MESH)
    with pytest.raises(ValueError, match="'y'.*not an axis"):
        xs.enable_manual_sharding(wd, ("y", None), mesh=MESH)


def test_gradients_through_enable_and_disable_manual_sharding_match_eager():
    """Autograd through a region of enable_/disable_manual_sharding (Note [Regions under
    autograd]): the split tensor's history (an activation made before the region), a replicated
    weight read inside and an all_reduce inside all get eager's gradients; no new program after
    step 2."""
    g = torch.Generator().manual_seed(7)
    w, s, c = torch.randn(3, 3, generator=g), torch.randn(3, generator=g), _data(70)
    graphs, before = [], new_graphs()
    for step in range(4):
        x = _data(80 + step)
        wd, sd = w.to(DEV).requires_grad_(), s.to(DEV).requires_grad_()
        xd = x.to(DEV).requires_grad_()
        h = xd * sd  # computed before the region: its gradient reaches x and s
        block = xs.enable_manual_sharding(h, ("x", None), mesh=MESH).global_tensor
        y = torch.tanh(block @ wd)
        y = y / xm.all_reduce(xm.REDUCE_SUM, (y * y).sum())
        out = xs.disable_manual_sharding(y, ("x", None), (8, 3), mesh=MESH).global_tensor
        (out * c.to(DEV)).sum().backward()
        xm.mark_step()
        graphs.append(new_graphs() - before)
        before += graphs[-1]
        xe, we, se = (t.clone().requires_grad_() for t in (x, w, s))
        ys = [torch.tanh(b @ we) for b in _blocks(xe * se)]
        total = sum((b * b).sum() for b in ys)
        want = torch.cat([b / total for b in ys])
        (want * c).sum().backward()
        torch.testing.assert_close(out.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5)
        for got, ref in ((xd, xe), (wd, we), (sd, se)):
            torch.testing.assert_close(got.grad.cpu(), ref.grad, atol=1e-5, rtol=1e-5)
    assert graphs[2:] == [0, 0], graphs


def test_gradients_through_a_region_match_eager():
    """Autograd through ``_shard_map`` (Note [Regions under autograd]): the backward is the
    transposed region (psum, ppermute ring, all_gather), the input and closure gradients equal
    eager PyTorch's on the global math; no new program after step 2."""
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def body(a, w):
        s = xm.all_reduce(xm.REDUCE_SUM, (a * a).sum())
        r = xm.collective_permute(a, ring)
        return a / s.sqrt() + r * w, xm.all_gather(a * w, dim=0)

    f = _shard_map(body, MESH, (("x", None), (None,)), (("x", None), (None, None)))
    graphs, before = [], new_graphs()
    for step in range(4):
        x, w, c1, c2 = _data(30 + step), _data(40, (3,)), _data(50), _data(60)
        xd, wd = x.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
        out, gathered = f(xd, wd)
        ((out * c1.to(DEV)).sum() + (gathered * c2.to(DEV)).sum()).backward()
        xm.mark_step()
        graphs.append(new_graphs() - before)
        before += graphs[-1]
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        b = xe.chunk(4)
        s = sum((t * t).sum() for t in b)
        want = torch.cat([b[i] / s.sqrt() + b[(i - 1) % 4] * we for i in range(4)])
        ((want * c1).sum() + (xe * we * c2).sum()).backward()
        torch.testing.assert_close(out.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xd.grad.cpu(), xe.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(wd.grad.cpu(), we.grad, atol=1e-5, rtol=1e-5)
    assert graphs[2:] == [0, 0], graphs
