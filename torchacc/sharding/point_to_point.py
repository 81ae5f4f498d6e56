"""Point-to-point batches on the one engine (torch's ``batch_isend_irecv`` on the ``xla`` process
group): every rank's sends and receives as the collective_permutes they form together,
recorded in the step (Note [A batch of point-to-point ops])."""

from __future__ import annotations

import itertools

import torch

from torchacc.runtime.processes import rank, world_size
from torchacc.sharding.collectives import _check_tensors, _write, collective_permute

# Note [A batch of point-to-point ops]
# torch's ``batch_isend_irecv`` on the xla process group: every rank passes its own list of
# sends and receives, which only together say who sends what to whom. The ranks swap their lists
# (shapes, dtypes and peers, not data) through the coordination service (``rendezvous``), so each
# one sees every transfer and records the same collectives: the k-th send from a to b pairs with
# b's k-th receive from a; the transfers, in rank then list order, go into the first group whose
# sources and targets they do not repeat and whose shape and dtype they share; each group is one
# ``collective_permute`` (a ring, or any permutation, is one), recorded in the step like the
# other collectives. A member that sends nothing in a group sends zeros; a receiver's tensor is
# written with its group's result. Sends and receives that do not pair up are a ValueError on
# every rank naming them, before anything is recorded; a rank that never calls it is a
# RuntimeError naming it after TORCHACC_COLLECTIVE_TIMEOUT seconds.


def batch_exchange(ops, name="batch_isend_irecv"):
    """This process's point-to-point ops ``[(kind, peer, tensor)]`` (kind "send" or "recv") as
    collective_permutes every process records (Note [A batch of point-to-point ops])."""
    import json

    w, me = world_size(), rank()
    _check_tensors(name, [t for _, _, t in ops])
    mine = [(k, int(p), list(t.shape), str(t.dtype).replace("torch.", "")) for k, p, t in ops]
    every = _swap_lists(name, json.dumps(mine).encode())
    sends, recvs, unpaired = {}, {}, []
    for r, listed in enumerate(every):
        for i, (kind, peer, shape, dtype) in enumerate(listed):
            if not 0 <= peer < w:
                unpaired.append(f"rank {r}'s {kind} names rank {peer}, outside 0..{w - 1}")
                continue
            table, key = (sends, (r, peer)) if kind == "send" else (recvs, (peer, r))
            table.setdefault(key, []).append((tuple(shape), dtype, i))
    transfers = []
    for a, b in sorted(set(sends) | set(recvs)):
        out, into = sends.get((a, b), []), recvs.get((a, b), [])
        if len(out) != len(into):
            unpaired.append(
                f"rank {a} sends {len(out)} tensor(s) to rank {b}, which receives {len(into)} "
                f"from rank {a}"
            )
            continue
        for (s1, d1, i), (s2, d2, j) in zip(out, into):
            if (s1, d1) != (s2, d2):
                unpaired.append(
                    f"rank {a} sends a {d1} tensor of shape {s1} to rank {b}, which receives a "
                    f"{d2} tensor of shape {s2}"
                )
            transfers.append((a, i, b, j, s1, d1))
    if unpaired:
        raise ValueError(
            f"torchacc.distributed.{name}: the ranks' sends and receives do not pair up: "
            + "; ".join(unpaired)
        )
    groups = []  # [shape, dtype, pairs, sources, targets, my send index, my recv index]
    for a, i, b, j, shape, dtype in sorted(transfers):
        for g in groups:
            if g[0] == shape and g[1] == dtype and a not in g[3] and b not in g[4]:
                break
        else:
            g = [shape, dtype, [], set(), set(), None, None]
            groups.append(g)
        g[2].append((a, b))
        g[3].add(a)
        g[4].add(b)
        if a == me:
            g[5] = i
        if b == me:
            g[6] = j
    device = next((t.device for _, _, t in ops), None)
    for shape, dtype, pairs, _, _, send, recv in groups:
        if send is not None:
            x = ops[send][2]
        else:
            x = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        out = collective_permute(x, pairs)
        if recv is not None:
            _write([ops[recv][2]], [out])


_swaps = itertools.count()


def _swap_lists(name, payload):
    """Every process's ``payload`` (a json list), through the coordination service; a rank that
    does not post its own in TORCHACC_COLLECTIVE_TIMEOUT seconds is a RuntimeError naming it."""
    import json
    import time

    from torchacc.runtime.processes import _jax_distributed_client, env_int

    w, me = world_size(), rank()
    if w == 1:
        return [json.loads(payload)]
    client = _jax_distributed_client()
    n = next(_swaps)
    client.key_value_set_bytes(f"torchacc/p2p/{n}/{me}", payload)
    if n >= 2:  # every rank has read my list n - 2 before it posted its n - 1, which I have read
        client.key_value_delete(f"torchacc/p2p/{n - 2}/{me}")
    seconds = env_int("TORCHACC_COLLECTIVE_TIMEOUT", 60)
    deadline = time.monotonic() + seconds
    out, missing = [], []
    for r in range(w):
        ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            out.append(json.loads(client.blocking_key_value_get_bytes(f"torchacc/p2p/{n}/{r}", ms)))
        except Exception:
            missing.append(r)
    if missing:
        raise RuntimeError(
            f"torchacc.distributed.{name}: rank {me} waited {seconds} s for the lists of sends "
            f"and receives of rank(s) {missing} (call #{n + 1}): every rank of the group must "
            f"call {name}, the same number of times"
        )
    return out
