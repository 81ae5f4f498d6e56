"""Worker for tests/test_horovod.py: one rank of a 2-process ``torchacc.horovod`` job.

    RANK=.. WORLD_SIZE=2 ... python tests/hvd_worker.py OUT     (or mpirun's variables instead)

It checks everything itself against math done locally (each rank knows what every rank
contributes) and against single-process training on the full batch, then writes
``OUT/hvd-<rank>.json`` listing the checks that passed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import torch
import torch.nn as nn

import torchacc
import torchacc.distributed as tdist
import torchacc.horovod as hvd
import torchacc.nn
from torchacc import metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_counts import new_graphs  # noqa: E402

DEV = torchacc.device()
W = 2
done = []


def close(got, want, what, rtol=1e-6, atol=1e-6):
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    done.append(what)


def raises(exc, text, fn, what):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{what}: {e}"
        done.append(what)
        return
    raise AssertionError(f"{what}: no {exc.__name__}")


def per_rank(r, shape=(3, 4), dtype=torch.float32):
    n = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)
    return (n * (r + 1) - 3 * r + 0.25).to(dtype)


# --------------------------------------------------------------------------------------------
# collectives, on CPU tensors and on torchacc tensors


def collectives(me, to):
    path = "device" if to is not None else "cpu"
    put = (lambda t: t.to(DEV)) if to is not None else (lambda t: t.clone())
    xs = [per_rank(r) for r in range(W)]
    x = put(xs[me])
    close(hvd.allreduce(x), (xs[0] + xs[1]) / 2, f"{path} allreduce Average")
    close(hvd.allreduce(x, op=hvd.Sum), xs[0] + xs[1], f"{path} allreduce Sum")
    close(hvd.allreduce(x, op=hvd.Min), torch.minimum(*xs), f"{path} allreduce Min")
    close(hvd.allreduce(x, op=hvd.Max), torch.maximum(*xs), f"{path} allreduce Max")
    close(hvd.allreduce(x, op=hvd.Product), xs[0] * xs[1], f"{path} allreduce Product")
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    close(got, (xs[0] + xs[1]) * 0.5, f"{path} allreduce pre/postscale")
    close(x, xs[me], f"{path} allreduce leaves its input")
    y = put(xs[me])
    assert hvd.allreduce_(y, op=hvd.Sum) is y
    close(y, xs[0] + xs[1], f"{path} allreduce_ in place")
    h = hvd.allreduce_async(x, op=hvd.Max)
    while not hvd.poll(h):
        pass
    close(hvd.synchronize(h), torch.maximum(*xs), f"{path} allreduce_async + poll + synchronize")
    ints = [torch.arange(5, dtype=torch.int64) * (r + 2) for r in range(W)]
    got = hvd.grouped_allreduce([x, put(ints[me])], op=hvd.Sum)
    close(got[0], xs[0] + xs[1], f"{path} grouped_allreduce float")
    close(got[1], ints[0] + ints[1], f"{path} grouped_allreduce int64")
    # allgather with different dim 0 on the ranks
    rows = [
        torch.arange(r + 2, dtype=torch.float32)[:, None] * torch.ones(1, 3) + r for r in (0, 1)
    ]
    close(hvd.allgather(put(rows[me])), torch.cat(rows), f"{path} allgather unequal dim 0")
    close(hvd.broadcast(x, 1), xs[1], f"{path} broadcast from root 1")
    z = put(xs[me])
    hvd.broadcast_(z, 1)
    close(z, xs[1], f"{path} broadcast_ from root 1")
    # alltoall with splits: rank r sends splits[r][d] rows to rank d
    splits = [[1, 3], [2, 0]]
    data = [
        torch.arange(4, dtype=torch.float32)[:, None] * torch.ones(1, 2) + 10 * r for r in (0, 1)
    ]
    data[1] = data[1][:2]
    out, received = hvd.alltoall(put(data[me]), splits=splits[me])
    want = torch.cat([data[src].split(splits[src])[me] for src in range(W)])
    close(out, want, f"{path} alltoall with splits")
    assert received.tolist() == [splits[src][me] for src in range(W)], received
    even = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (me + 1)
    base = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    close(
        hvd.alltoall(put(even)),
        torch.cat([base[2 * me : 2 * me + 2] * (r + 1) for r in (0, 1)]),
        f"{path} alltoall even",
    )
    full = xs[0] + xs[1]
    close(
        hvd.reducescatter(x, op=hvd.Sum),
        full[:2] if me == 0 else full[2:],
        f"{path} reducescatter uneven (3 rows)",
    )
    four = torch.cat([xs[0], xs[0][:1]]) * (me + 1)
    red = (torch.cat([xs[0], xs[0][:1]]) * 3) / 2
    close(hvd.reducescatter(put(four)), red[2 * me : 2 * me + 2], f"{path} reducescatter Average")


def host_collectives(me):
    assert hvd.allgather_object({"rank": me}) == [{"rank": 0}, {"rank": 1}]
    assert hvd.broadcast_object(("from", me), root_rank=1) == ("from", 1)
    hvd.barrier()
    assert hvd.join() in (0, 1)
    done.append("objects, barrier, join")
    bad = torch.ones(2 + me)
    raises(ValueError, "differ across ranks", lambda: hvd.allreduce(bad), "shape mismatch error")
    one = torch.ones(2)
    raises(ValueError, "from root rank", lambda: hvd.broadcast(one, me), "root mismatch error")


# --------------------------------------------------------------------------------------------
# training: 2 ranks x batch B == 1 process x batch 2B


def models(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 3)


def batch(step, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def train(me, *, device=False, passes=1, compression=hvd.Compression.none, steps=3, B=4):
    """Returns (this rank's parameters after DistributedOptimizer training, a 1-process
    reference on the full batch)."""
    m1, m2 = models(0)
    r1, r2 = models(0)
    if device:
        m1, m2 = m1.to(DEV), m2.to(DEV)
    params = list(m1.parameters()) + list(m2.parameters())
    opt = torch.optim.SGD(params, lr=0.1 * hvd.size(), momentum=0.9)
    named = [(f"a.{n}", p) for n, p in m1.named_parameters()]
    named += [(f"b.{n}", p) for n, p in m2.named_parameters()]
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=named, compression=compression, backward_passes_per_step=passes
    )
    ref_params = list(r1.parameters()) + list(r2.parameters())
    ref = torch.optim.SGD(ref_params, lr=0.1 * W, momentum=0.9)
    programs = []
    for step in range(steps):
        opt.zero_grad()
        ref.zero_grad()
        for k in range(passes):
            x, y = batch(step * passes + k, W * B)
            xb, yb = x[me * B : (me + 1) * B], y[me * B : (me + 1) * B]
            if device:
                xb, yb = xb.to(DEV), yb.to(DEV)
            nn.functional.mse_loss(m2(m1(xb)), yb).backward()
            nn.functional.mse_loss(r2(r1(x)), y).backward()
        if device and step == steps - 1:
            metrics.clear_all()
        opt.step()
        ref.step()
        if device:
            torchacc.sync()
            if step == steps - 1:
                programs = [
                    new_graphs(),
                    len(metrics.metric_samples("ExecuteTime") or []),
                    metrics.counter_value("TransferFromDevice") or 0,
                ]
    return [p.detach().cpu() for p in params], [p.detach() for p in ref_params], programs


def check_training(me):
    for label, kw, tol in (
        ("cpu", {}, 1e-5),
        ("cpu backward_passes_per_step=2", {"passes": 2}, 1e-5),
        ("cpu Compression.fp16", {"compression": hvd.Compression.fp16}, 2e-3),
        ("device", {"device": True}, 1e-5),
        ("device backward_passes_per_step=2", {"device": True, "passes": 2}, 1e-5),
    ):
        got, want, programs = train(me, **kw)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            g0, g1 = hvd.allgather(g[None])
            assert torch.equal(g0, g1), f"{label}: parameter {i} differs across ranks"
            close(g, w, f"train {label} param {i}", rtol=tol, atol=tol)
        if kw.get("device"):
            # the last step: no compile, one program, nothing read back from the device
            assert programs == [0, 1, 0], f"{label}: (new graphs, programs, reads) = {programs}"
            done.append(f"train {label}: one program, no compile, no device read")


def check_optimizer_api(me):
    m = nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    x = torch.full((3, 4), float(me + 1))
    m(x).sum().backward()
    opt.synchronize()
    reduced = [p.grad.clone() for p in m.parameters()]
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    close(reduced[1], torch.full((2,), 3.0), "synchronize: reduced bias grad (average of 3, 3)")
    close(reduced[0], torch.full((2, 4), 4.5), "synchronize: reduced weight grad")
    lin = nn.Linear(2, 2)
    raises(
        ValueError,
        "duplicates: ['w']",
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(lin.parameters(), lr=1),
            named_parameters=[("w", lin.weight), ("w", lin.bias)],
        ),
        "duplicate names",
    )
    raises(
        ValueError,
        "not in it (shapes [(2,)])",
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(lin.parameters(), lr=1), named_parameters=[("w", lin.weight)]
        ),
        "missing names",
    )


def check_broadcasts(me, tmp):
    # parameters: ranks start different; a merged state_dict of two models
    a, b = models(me)
    sd = {}
    sd.update({f"a.{k}": v for k, v in a.state_dict().items()})
    sd.update({f"b.{k}": v for k, v in b.state_dict().items()})
    hvd.broadcast_parameters(sd, root_rank=0)
    want_a, want_b = models(0)
    for p, q in zip(
        list(a.parameters()) + list(b.parameters()),
        list(want_a.parameters()) + list(want_b.parameters()),
        strict=True,
    ):
        close(p, q.detach(), "broadcast_parameters cpu", rtol=0, atol=0)
    # torchacc device: rank 0 alone loads a checkpoint (pending work differs), then broadcast
    net = nn.Linear(5, 3)
    torch.manual_seed(7)
    saved = nn.Linear(5, 3)
    if me == 0:
        torch.save(saved.state_dict(), os.path.join(tmp, "ckpt.pt"))
    hvd.barrier()
    net = net.to(DEV)
    torchacc.sync()
    if me == 0:
        net.load_state_dict(torch.load(os.path.join(tmp, "ckpt.pt")))
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    close(net.weight, saved.weight.detach(), "broadcast_parameters after rank-0 load", 0, 0)
    # optimizer state: rank 0 has stepped (momentum buffers, lr 0.1); rank 1 is fresh (lr 0.5)
    m = nn.Linear(3, 2)
    hvd.broadcast_parameters(m.state_dict(), 0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1 if me == 0 else 0.5, momentum=0.9)
    if me == 0:
        m(torch.ones(2, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1, opt.param_groups[0]["lr"]
    buf = opt.state[m.bias]["momentum_buffer"]
    close(buf, torch.full((2,), 2.0), "broadcast_optimizer_state buffers + lr")


def check_sync_batch_norm(me, device):
    sizes = (3, 5)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(sum(sizes), 4, 2, generator=g) * 3 + 1
    mine = full[: sizes[0]] if me == 0 else full[sizes[0] :]
    bn = nn.BatchNorm1d(4)
    sbn = hvd.SyncBatchNorm(4)
    with torch.no_grad():
        bn.weight.copy_(torch.arange(4.0) + 1)
        sbn.weight.copy_(torch.arange(4.0) + 1)
    x = mine.clone().requires_grad_()
    if device:
        sbn = sbn.to(DEV)
    xin = x.to(DEV) if device else x
    out = sbn(xin)
    (out * out).sum().backward()
    ref_x = full.clone().requires_grad_()
    ref = bn(ref_x)
    (ref * ref).sum().backward()
    lo = 0 if me == 0 else sizes[0]
    path = "device" if device else "cpu"
    close(out, ref[lo : lo + sizes[me]].detach(), f"SyncBatchNorm {path} output", 1e-5, 1e-5)
    close(sbn.running_mean, bn.running_mean, f"SyncBatchNorm {path} running_mean", 1e-5, 1e-5)
    close(sbn.running_var, bn.running_var, f"SyncBatchNorm {path} running_var", 1e-5, 1e-5)
    close(x.grad, ref_x.grad[lo : lo + sizes[me]], f"SyncBatchNorm {path} input grad", 1e-4, 1e-4)


def check_dropin(tmp):
    """``import torchacc.distributed as dist`` as the seed's DDP path uses it."""
    assert tdist.use_torchacc is True
    # the seed's train.sh: a one-process script; the launcher's job replaces its world and rank
    tdist.init_process_group("nccl", init_method="tcp://127.0.0.1:88", world_size=1, rank=0)
    me = tdist.get_rank()
    assert (tdist.get_world_size(), tdist.get_local_rank()) == (W, me)
    for path, put in (("cpu", lambda t: t.clone()), ("device", lambda t: t.to(DEV))):
        xs = [per_rank(r) for r in range(W)]
        x = put(xs[me])
        assert tdist.all_reduce(x, op=tdist.ReduceOp.MAX) is None
        close(x, torch.maximum(*xs), f"dist.all_reduce {path} MAX in place")
        y = put(xs[me])
        tdist.broadcast(y, src=1)
        close(y, xs[1], f"dist.broadcast {path} src=1")
        outs = [put(torch.zeros(3, 4)) for _ in range(W)]
        tdist.all_gather(outs, put(xs[me]))
        close(torch.stack([o.cpu() for o in outs]), torch.stack(xs), f"dist.all_gather {path}")
        tdist.barrier()
        # DDP: 2 ranks x batch 4 == 1 process x batch 8 (ranks start different: DDP broadcasts)
        torch.manual_seed(me)
        model = nn.Linear(6, 3)
        torch.manual_seed(0)
        ref = nn.Linear(6, 3)
        with torch.no_grad():
            want0 = ref.weight.clone()
        if me == 0:
            model.load_state_dict(ref.state_dict())
        model = model.to(DEV) if path == "device" else model
        ddp = torchacc.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            x, t = batch(step, 2 * 4)
            xb, tb = put(x[me * 4 : me * 4 + 4]), put(t[me * 4 : me * 4 + 4])
            opt.zero_grad()
            nn.functional.mse_loss(ddp(xb), tb).backward()
            opt.step()
            if path == "device":
                torchacc.sync()
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x), t).backward()
            ref_opt.step()
        assert not torch.equal(want0, ref.weight.detach())
        close(
            model.weight, ref.weight.detach(), f"DDP {path} averages like one process", 1e-5, 1e-5
        )
    m = nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01 if me == 0 else 0.5)
    if me == 0:
        m(torch.ones(2, 3)).sum().backward()
        opt.step()
    tdist.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01 and float(opt.state[m.bias]["step"]) == 1.0
    close(opt.state[m.bias]["exp_avg"], torch.full((2,), 0.2), "dist.broadcast_optimizer_state")


def main():
    faulthandler.register(signal.SIGUSR1)
    out = sys.argv[1]
    raises(ValueError, "hvd.init()", hvd.rank, "rank() before init()")
    check_dropin(out)
    hvd.init()  # adopts the process group the drop-in made
    me = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size(), hvd.cross_rank()) == (W, W, 1, 0)
    assert hvd.local_rank() == me and hvd.is_initialized()
    done.append("init from the launcher's environment")
    collectives(me, None)
    collectives(me, DEV)
    host_collectives(me)
    check_optimizer_api(me)
    check_broadcasts(me, out)
    check_sync_batch_norm(me, False)
    check_sync_batch_norm(me, True)
    check_training(me)
    hvd.shutdown()
    assert not hvd.is_initialized()
    with open(os.path.join(out, f"hvd-{me}.json"), "w") as f:
        json.dump(done, f)


if __name__ == "__main__":
    main()
