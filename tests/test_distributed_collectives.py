"""Collectives: a 2-process job checks every collective against the math; in-process tests cover
the SPMD compile path on a one-device mesh and the one-process helpers."""

import pytest
import torch
from distributed_launch import load, report, torchrun

import torchacc
from torchacc.distributed import collectives as C
from torchacc.runtime import processes as runtime

EXPECTED_CHECKS = {
    "ranks",
    "all_reduce",
    "dist.all_reduce",
    "xm.all_reduce",
    "xm.all_gather",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "barrier",
    "rendezvous",
    "cpu_tensor",
    "errors",
    "send_recv",
    "broadcast_parameters",
    "distributed_sampler",
    "mp_device_loader",
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collectives_two_processes(tmp_path):
    proc = torchrun("collectives", tmp_path)
    assert proc.returncode == 0, report(proc)
    for rank in range(2):
        got = load(tmp_path, "collectives", rank)
        assert got["world"] == 2
        assert set(got["checks"]) == EXPECTED_CHECKS, report(proc)
    errors = load(tmp_path, "collectives", 0)["errors"]
    assert set(errors) == {
        "all_reduce",
        "gather",
        "all_to_all_single",
        "avg",
        "all_to_all lengths",
        "subgroup",
    }


# ------------------------------------------------------------------------------------------------
# in-process: one device, world size 1


def dev(t):
    return t.to(torchacc.device())


def test_one_process_helpers_are_local_math():
    assert runtime.world_size() == 1 and runtime.rank() == 0
    x = dev(torch.arange(6.0).reshape(2, 3))
    torch.testing.assert_close(C.all_reduce("sum", x, scale=0.5).cpu(), x.cpu() * 0.5)
    grads = [dev(torch.ones(3)), dev(torch.full((2,), 4.0))]
    assert C.all_reduce("sum", grads, scale=0.25) is grads
    torch.testing.assert_close(grads[1].cpu(), torch.full((2,), 1.0))
    torch.testing.assert_close(C.all_gather(x, dim=1).cpu(), x.cpu())
    assert C.all_gather(dev(torch.tensor(3.0))).cpu().tolist() == [3.0]
    torch.testing.assert_close(C.reduce_scatter("sum", x, 2.0, 0, 1).cpu(), x.cpu() * 2)
    torch.testing.assert_close(C.broadcast(x, 0).cpu(), x.cpu())
    torch.testing.assert_close(C.all_to_all(x, 0, 1, 1).cpu(), x.cpu())
    assert C.rendezvous("tag", b"me") == [b"me"]
    C.barrier()


def test_errors_name_the_op():
    x = dev(torch.ones(2))
    with pytest.raises(ValueError, match=r"all_reduce: groups=\[\[0\], \[1\]\] do not partition"):
        C.all_reduce("sum", [x], groups=[[0], [1]])
    with pytest.raises(NotImplementedError, match="avg"):
        C.all_reduce("avg", dev(torch.ones(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="unknown reduce type"):
        C.all_reduce("median", x)
    with pytest.raises(TypeError, match="torchacc tensors"):
        C.all_reduce("sum", torch.ones(2, device="meta"))
    # plain CPU tensors are accepted (torchacc.compile_step steps): one process, local math
    torch.testing.assert_close(C.all_reduce("sum", torch.ones(2), scale=0.5), torch.full((2,), 0.5))
    C.all_reduce("sum", [x], groups=[[0]])  # the whole (one-process) world is fine


def test_one_process_results_are_new_tensors():
    """A single tensor in gives a new tensor out (torch_xla's contract), even in one process: an
    in-place change of the input afterwards must not show in the result, and vice versa."""
    x = dev(torch.arange(6.0).reshape(2, 3))
    want = x.cpu().clone()
    outs = {
        "all_reduce": C.all_reduce("sum", x),
        "all_gather": C.all_gather(x, dim=0),
        "reduce_scatter": C.reduce_scatter("sum", x, 1.0, 0, 1),
        "broadcast": C.broadcast(x, 0),
        "all_to_all": C.all_to_all(x, 0, 0, 1),
    }
    x.add_(100.0)
    for name, y in outs.items():
        assert y is not x, name
        torch.testing.assert_close(y.cpu(), want, msg=lambda m, n=name: f"{n}: {m}")
        y.mul_(0.0)
    torch.testing.assert_close(x.cpu(), want + 100.0)


def test_lists_are_updated_in_place_and_empty_lists_pass_through():
    empty = []
    assert C.all_reduce("sum", empty) is empty and C.broadcast(empty) is empty
    items = [dev(torch.tensor([1.0, -2.0])), dev(torch.tensor([3, 4]))]
    assert C.broadcast(items, 0) is items
    assert items[0].cpu().tolist() == [1.0, -2.0] and items[1].cpu().tolist() == [3, 4]
    outs = [dev(torch.zeros(2)), dev(torch.zeros(3))]
    got = C.reduce_scatter("sum", [dev(torch.ones(2)), dev(torch.full((3,), 2.0))], output=outs)
    assert got is outs and outs[1].cpu().tolist() == [2.0, 2.0, 2.0]


def test_bad_arguments_raise_naming_the_problem():
    x = dev(torch.arange(6.0).reshape(2, 3))
    ints = dev(torch.arange(4))
    with pytest.raises(NotImplementedError, match=r"scale=0\.5 on a torch\.int64 tensor"):
        C.all_reduce("sum", ints, scale=0.5)
    with pytest.raises(NotImplementedError, match=r"scale=2\.0 on a torch\.int64"):
        C.reduce_scatter("sum", ints, scale=2.0)
    with pytest.raises(NotImplementedError, match="'and' is supported for bool tensors only"):
        C.all_reduce("and", ints)
    with pytest.raises(NotImplementedError, match="complex"):
        C.all_reduce("sum", dev(torch.ones(2, dtype=torch.complex64)))
    with pytest.raises(NotImplementedError, match="reduce_scatter: shard_count=2 must equal"):
        C.reduce_scatter("sum", x, shard_count=2)
    with pytest.raises(NotImplementedError, match="all_to_all: split_count=2 must equal"):
        C.all_to_all(x, split_count=2)
    with pytest.raises(NotImplementedError, match=r"rendezvous: replicas=\[0, 1\]"):
        C.rendezvous("tag", b"x", replicas=[0, 1])
    assert C.rendezvous("tag", b"x", replicas=[0]) == [b"x"]  # the whole (one-process) world
    with pytest.raises(ValueError, match=r"broadcast: src=1 is not a rank in \[0, 1\)"):
        C.broadcast(x, src=1)
    with pytest.raises(ValueError, match=r"broadcast: src=-1"):
        C.broadcast(x, src=-1)
    with pytest.raises(ValueError, match="reduce_scatter: groups=.*do not partition"):
        C.reduce_scatter("sum", x, groups=[[0], [1]])
    with pytest.raises(NotImplementedError, match="reduce op .* is unsupported"):
        C.all_reduce(torch.distributed.ReduceOp.PREMUL_SUM, x)


def test_collective_ops_compile_as_spmd_program():
    """The recorded collective ops run through sharding.manual.compile_manual (one device here)."""
    from torchacc import program as compiler
    from torchacc.program.cache import _cache
    from torchacc.sharding.manual import ManualExecutable as SpmdExecutable

    ops = C.ops
    x = dev(torch.arange(6.0).reshape(2, 3))
    n = dev(torch.tensor([1, 2]))
    flags = dev(torch.tensor([True, False]))
    before = compiler.cache_size()
    s, i = ops.all_reduce.default([x * 2, n], "sum", 0.5, True)
    mx, fl = ops.all_reduce.default([x, flags], "max", 1.0, False)
    g = ops.all_gather.default(x, 1, 1)
    b = ops.broadcast.default([x, n, flags], 0)
    rs = ops.reduce_scatter.default(x, "avg", 1.0, False, 0, 1)
    a2a = ops.all_to_all.default(x, 0, 1, 1)
    y = s + 1  # ordinary ops after a collective live in the same SPMD program
    torchacc.sync()
    assert compiler.cache_size() == before + 1
    exe = next(reversed(_cache.values()))
    assert isinstance(exe, SpmdExecutable)
    torch.testing.assert_close(y.cpu(), x.cpu() + 1)
    torch.testing.assert_close(i.cpu(), n.cpu())
    torch.testing.assert_close(mx.cpu(), x.cpu())
    assert fl.cpu().tolist() == [True, False]
    for t in (g, rs, a2a, b[0]):
        torch.testing.assert_close(t.cpu(), x.cpu())
    assert b[1].cpu().tolist() == [1, 2] and b[2].cpu().tolist() == [True, False]


def test_graph_order_is_creation_order():
    """Every rank must build the same graph: live storages come back oldest first."""
    from torchacc.ir import live_storages

    ts = [dev(torch.full((2,), float(k))) for k in range(50)]
    del ts[::3]  # dead storages in between
    junk = [t + 1 for t in ts for _ in range(100)]  # more than the registry keeps before pruning
    del junk
    mine = {id(t._st) for t in ts}
    ordered = [st for st in live_storages() if id(st) in mine]
    assert [id(st) for st in ordered] == [id(t._st) for t in ts]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_point_to_point_three_processes(tmp_path):
    """batch_isend_irecv rings and two-way exchanges, and blocking send/recv between two of three
    processes (tests/distributed_worker.py scenario_p2p checks the values)."""
    proc = torchrun("p2p", tmp_path, nproc=3)
    assert proc.returncode == 0, report(proc)
    for rank in range(3):
        got = load(tmp_path, "p2p", rank)
        assert got["world"] == 3
        assert got["checks"] == ["ring", "both_ways", "send_recv", "unpaired"], got
