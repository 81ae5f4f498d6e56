"""Worker for the multi-process tests (tests/test_distributed_*.py), one process per rank.

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed_worker.py collectives OUT
    python -m torch.distributed.run --nproc_per_node=2 tests/distributed_worker.py train OUT ...
    RANK=.. WORLD_SIZE=2 ... python tests/distributed_worker.py fail OUT --mode raise

Every scenario checks its results itself (assertions against the math on CPU) and writes
``OUT/<scenario>-<rank>.json`` with what it checked, so the test can tell "ran and passed" from
"never got there".
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import torchacc
import torchacc.torch_xla.core.xla_model as xm
import torchacc.torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")
from torchacc.distributed import collectives as C
from torchacc.runtime import processes as runtime

DEV = torchacc.device()


def to_dev(t):
    return t.to(DEV)


def write(out, name, payload):
    path = os.path.join(out, f"{name}-{runtime.rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def close(got, want, what, rtol=1e-6, atol=1e-6):
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------
# collectives


def per_rank(r, shape=(3, 4), dtype=torch.float32):
    """What rank ``r`` contributes (known to every rank, so each can check the math)."""
    n = math.prod(shape)
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    return (base * (r + 1) - 3 * r + 0.25).to(dtype)


_late = iter(range(1000))


def _late_barrier(out, r, barrier):
    """``barrier()`` must hold rank 0 until the last rank arrives: the last rank comes late and
    leaves a mark just before it enters, which rank 0 must see once its barrier returns."""
    mark = os.path.join(out, f"arrived-{next(_late)}")
    if r == dist.get_world_size() - 1:
        time.sleep(1.0)
        with open(mark, "w"):
            pass
    barrier()
    if r == 0:
        assert os.path.exists(mark), f"{barrier}: rank 0 left before the last rank arrived"


def scenario_collectives(args):
    dist.init_process_group(backend="xla", init_method="env://")
    W, r = dist.get_world_size(), dist.get_rank()
    assert (W, r) == (runtime.world_size(), runtime.rank()), "dist vs runtime ranks"
    assert W == int(os.environ["WORLD_SIZE"]) and r == int(os.environ["RANK"])
    assert runtime.local_rank() == int(os.environ["LOCAL_RANK"])
    assert (xm.xrt_world_size(), xm.get_ordinal()) == (W, r), "xm vs dist ranks"
    checks = ["ranks"]
    ranks = range(W)
    allr = [per_rank(q) for q in ranks]
    ints = [torch.arange(5, dtype=torch.int64) * (q + 2) - q for q in ranks]

    # ---- phase 1: record many collectives, then one sync runs them all -------------------
    a, b, c = to_dev(allr[r]), to_dev(ints[r]), to_dev(per_rank(r, (4,), torch.bfloat16))
    lst = [a.clone(), b.clone()]
    C.all_reduce("sum", lst)  # in place, one coalesced collective
    scaled = [a.clone(), c.clone()]
    C.all_reduce("sum", scaled, scale=1.0 / W)
    single = {op: C.all_reduce(op, a) for op in ("sum", "avg", "min", "max", "mul")}
    flags = to_dev(torch.tensor([True, r == 0, False]))
    f_and, f_or = C.all_reduce("and", flags), C.all_reduce("or", flags)
    f_sum = C.all_reduce("sum", flags)
    d_ops = {}
    for name, op in (
        ("SUM", dist.ReduceOp.SUM),
        ("AVG", dist.ReduceOp.AVG),
        ("MIN", dist.ReduceOp.MIN),
        ("MAX", dist.ReduceOp.MAX),
        ("PRODUCT", dist.ReduceOp.PRODUCT),
    ):
        t = a.clone()
        work = dist.all_reduce(t, op=op, async_op=True)
        assert work.wait()
        d_ops[name] = t
    coalesced = [a.clone(), a[0].clone()]
    dist.all_reduce_coalesced(coalesced)
    red = a.clone()
    assert dist.reduce(red, dst=0, async_op=True).wait()
    # gathers
    g_list = [to_dev(torch.zeros(3, 4)) for _ in ranks]
    assert dist.all_gather(g_list, a, async_op=True).wait()  # a Work that is already done
    g_cat = to_dev(torch.zeros(3 * W, 4))
    assert dist.all_gather_into_tensor(g_cat, a, async_op=True).wait()
    g_stack = to_dev(torch.zeros(W, 3, 4))
    dist.all_gather_into_tensor(g_stack, a)
    g_xm = C.all_gather(a, dim=1)
    g_int = C.all_gather(b, dim=0)
    g_scalar = C.all_gather(a.sum())
    # reduce-scatters
    rs_in = [to_dev(per_rank(r + q, (2, 4))) for q in ranks]
    rs_out = to_dev(torch.zeros(2, 4))
    assert dist.reduce_scatter(rs_out, rs_in, async_op=True).wait()
    big = to_dev(per_rank(r, (2 * W, 3)))
    rs_t = to_dev(torch.zeros(2, 3))
    dist.reduce_scatter_tensor(rs_t, big, op=dist.ReduceOp.MAX)
    rs_xm = C.reduce_scatter("sum", to_dev(per_rank(r, (3, 2 * W))), 0.5, 1, W)
    # broadcast, bit-exact (-0.0, nan, inf) and for ints / bools
    special = torch.tensor([-0.0, float("nan"), float("inf"), 1.5 + r, -2.0])
    bc_f, bc_i, bc_b = to_dev(special), to_dev(ints[r]), to_dev(torch.tensor([r == 1, True]))
    for t in (bc_f, bc_i, bc_b):
        assert dist.broadcast(t, src=1, async_op=True).wait()
    bc_xm = [a.clone()]
    C.collective_broadcast(bc_xm, root_ordinal=0)
    # all-to-all
    a2a_in = to_dev(per_rank(r, (2 * W, 3)))
    a2a_out = to_dev(torch.zeros(2 * W, 3))
    assert dist.all_to_all_single(a2a_out, a2a_in, async_op=True).wait()
    a2a_xm = C.all_to_all(to_dev(per_rank(r, (2, 2 * W))), 1, 0, W)
    a2a_list_out = [to_dev(torch.zeros(2)) for _ in ranks]
    a2a_list_in = [to_dev(torch.full((2,), 10.0 * r + q)) for q in ranks]
    assert dist.all_to_all(a2a_list_out, a2a_list_in, async_op=True).wait()

    # the torch_xla API (what recipes call), every reduce type, in-place lists, avg reductions
    xm_single = {op: xm.all_reduce(op, a) for op in ("sum", "mul", "min", "max")}
    xm_scaled = xm.all_reduce("sum", a, scale=0.25)
    xm_flags = {op: xm.all_reduce(op, flags) for op in ("and", "or")}
    xm_ints = {op: xm.all_reduce(op, b) for op in ("sum", "min", "max", "mul")}
    xm_list = [a.clone(), b.clone(), c.clone()]
    assert xm.all_reduce("max", xm_list, scale=1.0) is xm_list
    xm_gather0, xm_gather1 = xm.all_gather(a, dim=0), xm.all_gather(a, dim=1)
    xm_gather_out = to_dev(torch.zeros(W * 3, 4))
    xm.all_gather(a, dim=0, output=xm_gather_out)
    rs_src = to_dev(per_rank(r, (2 * W, 3)))
    rs_avg = C.reduce_scatter("avg", rs_src, 1.0, 0, W)
    rs_avg_scaled = C.reduce_scatter("avg", rs_src, 3.0, 0, W)
    rs_xm_mean = xm.reduce_scatter("sum", rs_src, 1.0 / W, 0, W)
    rs_d_avg = to_dev(torch.zeros(2, 3))
    dist.reduce_scatter_tensor(rs_d_avg, rs_src, op=dist.ReduceOp.AVG)
    rs_d_list = to_dev(torch.zeros(2, 4))
    dist.reduce_scatter(rs_d_list, rs_in, op=dist.ReduceOp.AVG)
    rs_d_min = to_dev(torch.zeros(2, 3))
    dist.reduce_scatter_tensor(rs_d_min, rs_src, op=dist.ReduceOp.MIN)

    torchacc.sync()

    # ---- check against the math ------------------------------------------------------------
    total = sum(allr)
    close(lst[0], total, "all_reduce list[0]")
    close(lst[1], sum(ints), "all_reduce list[1] int64")
    close(scaled[0], total / W, "all_reduce scale")
    wantc = sum(per_rank(q, (4,), torch.bfloat16).float() for q in ranks) / W
    close(scaled[1], wantc.to(torch.bfloat16), "all_reduce scale bf16", rtol=1e-2, atol=1e-2)
    stack = torch.stack(allr)
    close(single["sum"], total, "all_reduce sum")
    close(single["avg"], total / W, "all_reduce avg")
    close(single["min"], stack.min(0).values, "all_reduce min")
    close(single["max"], stack.max(0).values, "all_reduce max")
    close(single["mul"], stack.prod(0), "all_reduce product")
    fl = torch.stack([torch.tensor([True, q == 0, False]) for q in ranks])
    close(f_and, fl.all(0), "all_reduce and")
    close(f_or, fl.any(0), "all_reduce or")
    close(f_sum, fl.any(0), "all_reduce bool sum")
    close(d_ops["SUM"], total, "dist.all_reduce SUM")
    close(d_ops["AVG"], total / W, "dist.all_reduce AVG")
    close(d_ops["MIN"], stack.min(0).values, "dist.all_reduce MIN")
    close(d_ops["MAX"], stack.max(0).values, "dist.all_reduce MAX")
    close(d_ops["PRODUCT"], stack.prod(0), "dist.all_reduce PRODUCT")
    close(coalesced[0], total, "all_reduce_coalesced[0]")
    close(coalesced[1], total[0], "all_reduce_coalesced[1]")
    if r == 0:
        close(red, total, "dist.reduce")
    checks += ["all_reduce", "dist.all_reduce", "reduce"]
    close(xm_single["sum"], total, "xm.all_reduce sum")
    close(xm_single["mul"], stack.prod(0), "xm.all_reduce mul")
    close(xm_single["min"], stack.min(0).values, "xm.all_reduce min")
    close(xm_single["max"], stack.max(0).values, "xm.all_reduce max")
    close(xm_scaled, total * 0.25, "xm.all_reduce sum scale")
    close(xm_flags["and"], fl.all(0), "xm.all_reduce and")
    close(xm_flags["or"], fl.any(0), "xm.all_reduce or")
    istack = torch.stack(ints)
    close(xm_ints["sum"], istack.sum(0), "xm.all_reduce sum int64")
    close(xm_ints["min"], istack.min(0).values, "xm.all_reduce min int64")
    close(xm_ints["max"], istack.max(0).values, "xm.all_reduce max int64")
    close(xm_ints["mul"], istack.prod(0), "xm.all_reduce mul int64")
    close(xm_list[0], stack.max(0).values, "xm.all_reduce max list[0]")
    close(xm_list[1], istack.max(0).values, "xm.all_reduce max list[1]")
    cstack = torch.stack([per_rank(q, (4,), torch.bfloat16) for q in ranks])
    close(xm_list[2], cstack.max(0).values, "xm.all_reduce max list[2] bf16")
    close(xm_gather0, torch.cat(allr, 0), "xm.all_gather dim=0")
    close(xm_gather1, torch.cat(allr, 1), "xm.all_gather dim=1")
    close(xm_gather_out, torch.cat(allr, 0), "xm.all_gather output=")
    checks += ["xm.all_reduce", "xm.all_gather"]
    for q in ranks:
        close(g_list[q], allr[q], f"dist.all_gather[{q}]")
    close(g_cat, torch.cat(allr), "all_gather_into_tensor (concat)")
    close(g_stack, torch.stack(allr), "all_gather_into_tensor (stacked)")
    close(g_xm, torch.cat(allr, dim=1), "xm all_gather dim=1")
    close(g_int, torch.cat(ints), "all_gather int64")
    close(g_scalar, torch.stack([x.sum() for x in allr]), "all_gather of a scalar")
    checks += ["all_gather"]
    rs_full = sum(torch.stack([per_rank(q + k, (2, 4)) for k in ranks]) for q in ranks)
    close(rs_out, rs_full[r], "dist.reduce_scatter")
    big_all = torch.stack([per_rank(q, (2 * W, 3)) for q in ranks]).max(0).values
    close(rs_t, big_all[2 * r : 2 * r + 2], "reduce_scatter_tensor MAX")
    xs = sum(per_rank(q, (3, 2 * W)) for q in ranks) * 0.5
    close(rs_xm, xs[:, 2 * r : 2 * r + 2], "xm reduce_scatter dim=1 scale")
    rs_all = torch.stack([per_rank(q, (2 * W, 3)) for q in ranks])
    mine = slice(2 * r, 2 * r + 2)
    close(rs_avg, (rs_all.sum(0) / W)[mine], "reduce_scatter avg")
    close(rs_avg_scaled, (rs_all.sum(0) / W * 3.0)[mine], "reduce_scatter avg scale")
    close(rs_xm_mean, (rs_all.sum(0) / W)[mine], "xm.reduce_scatter sum scale 1/W")
    close(rs_d_avg, (rs_all.sum(0) / W)[mine], "dist.reduce_scatter_tensor AVG")
    close(rs_d_list, rs_full[r] / W, "dist.reduce_scatter AVG")
    close(rs_d_min, rs_all.min(0).values[mine], "dist.reduce_scatter_tensor MIN")
    checks += ["reduce_scatter"]
    got = bc_f.cpu()
    want = torch.tensor([-0.0, float("nan"), float("inf"), 2.5, -2.0])
    assert torch.equal(got.view(torch.int32)[[0, 2, 3, 4]], want.view(torch.int32)[[0, 2, 3, 4]])
    assert math.isnan(got[1].item()), f"broadcast nan: {got}"
    close(bc_i, ints[1], "broadcast int64")
    close(bc_b, torch.tensor([True, True]), "broadcast bool")
    close(bc_xm[0], allr[0], "collective_broadcast")
    checks += ["broadcast"]
    blocks = [per_rank(q, (2 * W, 3)) for q in ranks]
    close(a2a_out, torch.cat([blk[2 * r : 2 * r + 2] for blk in blocks]), "all_to_all_single")
    xa = [per_rank(q, (2, 2 * W)) for q in ranks]
    close(a2a_xm, torch.cat([x[:, 2 * r : 2 * r + 2] for x in xa], dim=0), "xm all_to_all")
    for q in ranks:
        close(a2a_list_out[q], torch.full((2,), 10.0 * q + r), f"dist.all_to_all[{q}]")
    checks += ["all_to_all"]

    # ---- phase 2: host-side sync, CPU tensors, errors ----------------------------------------
    _late_barrier(args.out, r, dist.barrier)
    payloads = C.rendezvous("hello", f"rank{r}".encode())
    assert payloads == [f"rank{q}".encode() for q in ranks], payloads
    cpu = torch.full((3,), float(r + 1))
    dist.all_reduce(cpu)
    close(cpu, torch.full((3,), float(sum(q + 1 for q in ranks))), "all_reduce of a CPU tensor")
    # the group's own monitored_barrier (dist.monitored_barrier itself is gloo-only)
    group = dist.distributed_c10d._get_default_group()
    _late_barrier(args.out, r, group.monitored_barrier)
    _late_barrier(args.out, r, lambda: group.monitored_barrier(datetime.timedelta(seconds=60)))
    checks += ["barrier", "rendezvous", "cpu_tensor"]
    errors = {}
    for name, call in (
        ("all_reduce", lambda: C.all_reduce("sum", [a], groups=[[0]])),
        ("gather", lambda: dist.gather(a, [a.clone(), a.clone()] if r == 0 else None, dst=0)),
        (
            "all_to_all_single",
            lambda: dist.all_to_all_single(a2a_out, a2a_in, [1, 2 * W - 1], [1, 2 * W - 1]),
        ),
        ("avg", lambda: C.all_reduce("avg", b)),
    ):
        try:
            call()
        except (NotImplementedError, ValueError) as e:  # groups=[[0]]: not a partition
            assert name in str(e), f"{name}: error does not name the op: {e}"
            errors[name] = str(e)
        else:
            raise AssertionError(f"{name}: expected NotImplementedError")
    # point to point in a 2-process job: each pair of matching calls is one ppermute
    sent, got = torch.full((3,), 5.0 + r).to(DEV), torch.zeros(3).to(DEV)
    if r == 0:
        dist.send(sent, dst=1)
        dist.recv(got, src=1)
    else:
        dist.recv(got, src=0)
        dist.send(sent, dst=0)
    close(got, torch.full((3,), 5.0 + (1 - r)), "dist.send/recv")
    checks += ["send_recv"]
    for outs, ins in (([a2a_list_out[0]], a2a_list_out), (a2a_list_out, [a2a_list_out[0]])):
        try:
            dist.all_to_all(outs, ins)
        except ValueError as e:
            assert f"all_to_all needs {W} tensors per list" in str(e), e
            errors["all_to_all lengths"] = str(e)
        else:
            raise AssertionError("all_to_all with a list of 1 tensor: expected ValueError")
    sub = dist.new_group([0])
    if r == 0:
        try:
            dist.all_reduce(a.clone(), group=sub)
        except NotImplementedError as e:
            assert "all_reduce" in str(e)
            errors["subgroup"] = str(e)
        else:
            raise AssertionError("subgroup all_reduce: expected NotImplementedError")
    checks += ["errors"]

    # ---- phase 3: parameter broadcast, DistributedSampler + MpDeviceLoader ------------------
    torch.manual_seed(100 + r)  # replicas start different ...
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(DEV)
    torch.manual_seed(100)
    want_model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    C.broadcast_parameters(model)  # ... until rank 0's values are broadcast
    torchacc.sync()
    for (name, p), q in zip(
        model.state_dict().items(), want_model.state_dict().values(), strict=True
    ):
        close(p, q, f"broadcast_parameters {name}", rtol=0, atol=0)
    checks += ["broadcast_parameters"]

    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from torchacc.torch_xla.distributed import parallel_loader as pl

    data = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    ds = TensorDataset(data, torch.arange(20))
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    assert sampler.num_replicas == W and sampler.rank == r
    mine = list(iter(sampler))
    others = [list(iter(DistributedSampler(ds, W, q, shuffle=True, seed=3))) for q in ranks]
    assert mine == others[r]
    assert sorted(sum(others, [])) == list(range(20)), "DistributedSampler shards"
    loader = DataLoader(ds, batch_size=3, sampler=sampler)
    device_loader = pl.MpDeviceLoader(loader, DEV)
    marks0 = torchacc.metrics.counter_value("MarkStep") or 0
    seen, sums = [], []
    for x, idx in device_loader:
        assert x.device.type == "torchacc" and idx.device.type == "torchacc"
        seen.append(idx)
        sums.append(C.all_reduce("sum", x.sum()))  # runs at the loader's next mark_step
    n_batches = len(loader)
    assert len(seen) == n_batches == len(device_loader)
    marks = (torchacc.metrics.counter_value("MarkStep") or 0) - marks0
    # as torch_xla: one mark_step as each batch is taken (the first one's is a no-op) and one
    # when the loader runs out
    assert marks == n_batches + 2, f"MpDeviceLoader: {marks} mark_steps for {n_batches} batches"
    got_idx = torch.cat([s.cpu() for s in seen]).tolist()
    assert got_idx == mine, f"loader order {got_idx} vs sampler {mine}"
    batches = [[o[i : i + 3] for i in range(0, len(o), 3)] for o in others]
    for k, s in enumerate(sums):
        want = sum(data[torch.tensor(batches[q][k])].sum() for q in ranks)
        close(s, want, f"loader batch {k} all_reduce")
    checks += ["distributed_sampler", "mp_device_loader"]

    write(args.out, "collectives", {"checks": checks, "errors": errors, "world": W})
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# training parity


def scenario_p2p(args):
    """Point to point on the xla process group in a job of more than two processes: a
    ``batch_isend_irecv`` ring (one collective_permute in the step, no new program after step 2),
    a two-way exchange with both neighbours, blocking send/recv between two ranks while the
    others do nothing, and a batch whose sends and receives do not pair up (a ValueError)."""
    from compile_counts import new_graphs

    dist.init_process_group(backend="xla", init_method="env://")
    W, r = dist.get_world_size(), dist.get_rank()
    assert W > 2, W
    checks, graphs = [], []
    nxt, prv = (r + 1) % W, (r - 1) % W
    for step in range(4):
        send = to_dev(per_rank(r) + step)
        got = to_dev(torch.zeros(3, 4))
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, got, prv)]
        )
        for q in reqs:
            q.wait()
        before = new_graphs()
        xm.mark_step()
        graphs.append(new_graphs() - before)
        close(got, per_rank(prv) + step, "batch_isend_irecv ring")
    assert graphs[2:] == [0, 0], graphs
    from torchacc.lazy.record import value_of

    checks.append("ring")
    # both neighbours at once: two permutations (to the right, to the left), one batch
    right, left = to_dev(torch.zeros(2)), to_dev(torch.zeros(2))
    mine = to_dev(torch.full((2,), float(r)))
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, left, prv),
            dist.P2POp(dist.isend, mine, nxt),
            dist.P2POp(dist.isend, mine * 10, prv),
            dist.P2POp(dist.irecv, right, nxt),
        ]
    )
    assert value_of(left).node is not None, "the exchange is recorded in the step"
    close(left, torch.full((2,), float(prv)), "from the left")
    close(right, torch.full((2,), 10.0 * nxt), "from the right")
    checks.append("both_ways")
    # blocking send/recv between ranks 0 and 2: the others take no part
    buf = to_dev(torch.full((3,), -1.0))
    if r == 0:
        dist.send(to_dev(torch.arange(3.0) + 7), dst=2)
    elif r == 2:
        dist.recv(buf, src=0)
        close(buf, torch.arange(3.0) + 7, "dist.recv from rank 0")
    if r == 2:
        dist.send(buf * 2, dst=0)
    elif r == 0:
        dist.recv(buf, src=2)
        close(buf, (torch.arange(3.0) + 7) * 2, "dist.recv from rank 2")
    checks.append("send_recv")
    # sends and receives that do not pair up: rank 0 sends to rank 1, which receives nothing
    op = dist.irecv if r == 2 else dist.isend
    try:
        dist.batch_isend_irecv([dist.P2POp(op, to_dev(torch.zeros(2)), 1 if r != 1 else 2)])
    except ValueError as e:
        assert "do not pair up" in str(e) and "rank 0 sends 1 tensor(s) to rank 1" in str(e), e
        checks.append("unpaired")
    write(args.out, "p2p", {"world": W, "checks": checks, "graphs": graphs})


def batch_for(step, full_batch):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(full_batch, 8, generator=g), torch.randn(full_batch, 4, generator=g)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _reduce_gradients(model, optimizer, api, world):
    """Average the gradients over the ranks the way a recipe does (before ``optimizer.step``)."""
    if api == "xm":  # the seed's recipe: xm._fetch_gradients + xm.all_reduce(scale=1/world)
        gradients = xm._fetch_gradients(optimizer)
        xm.all_reduce("sum", gradients, scale=1.0 / world)
        return "xm.all_reduce"
    if api == "reduce_gradients":
        xm.reduce_gradients(optimizer)
        return "xm.reduce_gradients"
    if api == "dist":  # torch.distributed on the "xla" process group
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        return "dist.all_reduce"
    return None  # xm.optimizer_step reduces by itself


# name -> (optimizer, how gradients are averaged). Plain SGD makes the update proportional to the
# averaged gradient, so a sum instead of a mean (or no reduction) changes the parameters directly;
# momentum and AdamW are there because recipes use them.
RECIPES = {
    "sgd": ("sgd_momentum", "xm"),
    "adamw": ("adamw", "dist"),
    "xm.optimizer_step": ("sgd", "optimizer_step"),
    "xm.reduce_gradients": ("sgd", "reduce_gradients"),
}


def _optimizer(kind, params):
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def scenario_train(args):
    """Train a tiny MLP for ``--steps`` steps: in one process on ``--batch`` samples, or in W
    processes on ``--batch`` samples each (rank r takes rows r*b..(r+1)*b of the same global
    batch), once per recipe in RECIPES."""
    W, r = runtime.world_size(), runtime.rank()
    if W > 1:
        dist.init_process_group(backend="xla", init_method="env://")
    result = {}
    for name, (opt_name, api) in RECIPES.items():
        full = args.batch * W
        model = make_model().to(DEV)
        if W > 1:
            C.broadcast_parameters(model)
        opt = _optimizer(opt_name, model.parameters())
        losses, used = [], None
        for step in range(args.steps):
            x, y = batch_for(step, full)
            rows = slice(r * args.batch, (r + 1) * args.batch)
            x, y = x[rows].to(DEV), y[rows].to(DEV)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            if api == "optimizer_step":
                xm.optimizer_step(opt)  # reduce_gradients + step, in one process too
                used = "xm.optimizer_step"
            else:
                if W > 1:
                    used = _reduce_gradients(model, opt, api, W)
                opt.step()
            torchacc.sync()
            losses.append(loss.detach())
        result[name] = {
            "params": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
            "losses": [float(v) for v in losses],
            "api": used,
        }
    write(args.out, f"train-{W}", result)
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# ZeRO-1 (torch_xla.distributed.zero_redundancy_optimizer)


def scenario_zero1(args):
    """ZeroRedundancyOptimizer(AdamW) with global-norm clipping on W ranks, each on its rows of
    one global batch, against eager AdamW + clip_grad_norm_ on the whole batch on the CPU. The
    first layer's dim 0 (5) does not divide by W = 2, so its slices are padded."""
    from torchacc.torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    W, r = runtime.world_size(), runtime.rank()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 4))
    model = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 4)).to(DEV)
    model.load_state_dict(ref.state_dict())
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        weight_decay=0.1,
        max_norm=0.05,
        save_master_weights=True,
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    # this rank's slices: dim 0 padded to a multiple of W, then split
    w0 = opt.base_optimizer.param_groups[0]["params"][0]
    assert tuple(w0.shape) == (-(-5 // W), 8), w0.shape
    norms = []
    for step in range(3):
        x, y = batch_for(step, 2 * W)
        rows = slice(2 * r, 2 * r + 2)
        nn.functional.mse_loss(model(x[rows].to(DEV)), y[rows].to(DEV)).backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        close(opt.grad_norm, torch.tensor(norms[-1]), f"grad norm at step {step}", rtol=1e-5)
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        close(got, want, f"ZeRO-1 parameter {name}", rtol=1e-5, atol=1e-6)
    state = opt.state_dict()
    exp_avg = state["base_state"][0]["exp_avg"]
    assert tuple(exp_avg.shape) == tuple(w0.shape), "optimizer state is per slice"
    assert norms[0] > 0.05, "the clipping was exercised"
    write(args.out, "zero1", {"world": W, "checks": ["slices", "grad_norm", "params", "state"]})
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# failure


def scenario_fail(args):
    """Steps with a collective, the host waiting for each; after step 3 each rank writes
    ``OUT/ready-<rank>``. Then rank ``--victim`` raises (``--mode raise``) or keeps going until the
    test kills it (``--mode kill``); with ``--idle`` the other ranks stop issuing collectives and
    sit in host code, so only the runtime's heartbeat can tell them the victim is gone."""
    W, r = runtime.world_size(), runtime.rank()
    x = to_dev(torch.ones(64))
    for step in range(1, 100000):
        if step > 3 and args.idle and r != args.victim:
            time.sleep(600)  # host work; never returns in a passing test
        x = C.all_reduce("sum", x, scale=1.0 / W)
        torchacc.sync()
        x.cpu()  # the host waits for the collective every step
        if step == 3:
            with open(os.path.join(args.out, f"ready-{r}"), "w") as f:
                f.write(str(os.getpid()))
        if step == 5 and r == args.victim and args.mode == "raise":
            raise RuntimeError("deliberate failure on the victim rank")
        time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["collectives", "p2p", "train", "fail", "zero1"])
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mode", choices=["raise", "kill"], default="raise")
    p.add_argument("--idle", action="store_true")
    p.add_argument("--victim", type=int, default=1)
    args = p.parse_args()
    {
        "collectives": scenario_collectives,
        "p2p": scenario_p2p,
        "train": scenario_train,
        "fail": scenario_fail,
        "zero1": scenario_zero1,
    }[args.scenario](args)


if __name__ == "__main__":
    main()
