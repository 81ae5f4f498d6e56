"""Point to point on the one engine: torch's ``batch_isend_irecv`` on the ``xla`` process group
(every rank's sends and receives as the collective_permutes they form together, recorded in the
step: Note [A batch of point-to-point ops]) and, in SPMD mode, the blocking ``send``/``recv``
between two processes of a job (Note [Send and receive in SPMD mode])."""

from __future__ import annotations

import itertools

import torch

from torchacc.runtime.processes import rank, world_size
from torchacc.sharding import collectives
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


# Note [Send and receive in SPMD mode]
# torch's blocking ``dist.send``/``recv`` are called by the two peers alone; with more than two
# processes the others take no part, so the transfer cannot be a collective of the step's program
# (that program spans every process). In SPMD mode a torchacc tensor is a global array over the
# engine mesh whose process axes are per-process code's: each process's devices hold its own
# value (Note [One mesh]), laid out over its local devices. ``pair_send_recv`` moves that value
# as one ppermute (XLA's collective-permute) in a program over the two processes' devices alone:
# a mesh ("pair", "local") whose row 0 is the sender's devices and row 1 the receiver's, device k
# of one row paired with the device of the other that holds the same block of the array; each
# device's block crosses to its partner, and the receiver's blocks form its new array, laid out
# as its buffer. The peers first swap their layouts through the coordination service (shape,
# dtype, partition spec and mesh): blocks pair up only when the layouts are the same, and two
# different ones are a ValueError on both peers naming them, not a hang or a garbled tensor. A
# tensor split over a process axis has no per-process value to send: a ValueError.

_pair_programs: dict = {}  # (pair devices, block shape, dtype) -> jitted ppermute
_pair_calls: dict = {}  # (source, target) -> how many transfers this process made between them


def send_recv(value, source, target, name="send"):
    """torch's blocking ``dist.send``/``recv`` of ``value`` from rank ``source`` to ``target``
    (both peers call it): in SPMD mode a program of the two peers (``pair_send_recv``), else
    ``collectives.send_recv``. The receiver's result."""
    from torchacc.sharding import api

    if source != target and api.is_spmd() and world_size() > 1 and collectives.in_region() is None:
        return pair_send_recv(value, int(source), int(target), name)
    return collectives.send_recv(value, source, target, name)


def pair_send_recv(value, source, target, name="send"):
    """SPMD mode: torchacc tensor ``value`` of process ``source`` at process ``target`` (Note
    [Send and receive in SPMD mode]); the receiver's result is a new tensor laid out as
    ``value`` there, the sender gets ``value`` back. Both peers call it in the same order, the
    sender with its data and the receiver with a buffer of the same shape, dtype and layout."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from torchacc.engine import execute
    from torchacc.ir import Value
    from torchacc.lazy.record import fresh, value_of

    me = rank()
    v = value_of(value)
    if v.node is not None:
        execute.run([v], donate=False)
    array = v.buf
    sharding = array.sharding
    layout = _layout_text(array)
    peer = target if me == source else source
    theirs = _swap_with_peer(name, source, target, me, peer, layout)
    if theirs != layout:
        sent, into = (layout, theirs) if me == source else (theirs, layout)
        raise ValueError(
            f"torchacc.distributed.{name}: rank {source} sends a tensor laid out as {sent} and "
            f"rank {target} receives into one laid out as {into}; a send and its recv need the "
            "same shape, dtype and layout"
        )
    index = sharding.devices_indices_map(tuple(array.shape))

    def block_of(d):
        return tuple((sl.start, sl.stop) for sl in index[d])

    def devices_of(process):
        return sorted(
            (d for d in sharding.device_set if d.process_index == process), key=lambda d: d.id
        )

    rows = [devices_of(source), []]
    left = devices_of(target)
    for d in rows[0]:
        match = next((e for e in left if block_of(e) == block_of(d)), None)
        if match is None:
            raise ValueError(
                f"torchacc.distributed.{name}: the tensor of shape {tuple(v.desc[0])} is split "
                f"over processes ({sharding.spec} over mesh {dict(sharding.mesh.shape)}); ranks "
                f"{source} and {target} hold different parts of it, not each its own value: "
                "send a tensor laid out over the local devices only"
            )
        left.remove(match)
        rows[1].append(match)
    shards = {sh.device: sh.data for sh in array.addressable_shards}
    block = tuple(next(iter(shards.values())).shape)
    pair = tuple(d.id for row in rows for d in row)
    key = (pair, block, str(array.dtype))
    entry = _pair_programs.get(key)
    if entry is None:
        mesh = Mesh(np.array(rows, dtype=object), ("pair", "local"))
        spec = PartitionSpec("pair", "local")

        def hop(x):
            return jax.lax.ppermute(x, "pair", [(0, 1)])

        region = jax.shard_map(hop, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        entry = _pair_programs[key] = (jax.jit(region), NamedSharding(mesh, spec))
    fn, pair_sharding = entry
    mine = rows[0] if me == source else rows[1]
    local = [shards[d].reshape((1, 1, *block)) for d in mine]
    out = fn(jax.make_array_from_single_device_arrays((2, len(mine), *block), pair_sharding, local))
    if me != target:
        return value
    got = [sh.data.reshape(block) for sh in out.addressable_shards]
    result = jax.make_array_from_single_device_arrays(tuple(array.shape), sharding, got)
    return fresh(Value(v.desc, array=result))


def _layout_text(array):
    s = array.sharding
    m = s.mesh
    devices = [d.id for d in m.devices.flat]
    spec = tuple(s.spec) + (None,) * (array.ndim - len(s.spec))  # ('x',) is ('x', None)
    return (
        f"{tuple(array.shape)} {array.dtype} {spec} over mesh {dict(m.shape)} (devices {devices})"
    )


def _swap_with_peer(name, source, target, me, peer, payload):
    """The peer's ``payload`` for this transfer between ``source`` and ``target``, through the
    coordination service; a peer that does not post its own in TORCHACC_COLLECTIVE_TIMEOUT
    seconds is a RuntimeError naming it."""
    import time

    from torchacc.runtime.processes import _jax_distributed_client, env_int

    client = _jax_distributed_client()
    n = _pair_calls.get((source, target), 0)
    _pair_calls[(source, target)] = n + 1
    prefix = f"torchacc/p2p-pair/{source}-{target}"
    client.key_value_set(f"{prefix}/{n}/{me}", payload)
    seconds = env_int("TORCHACC_COLLECTIVE_TIMEOUT", 60)
    start = time.monotonic()
    try:
        theirs = client.blocking_key_value_get(f"{prefix}/{n}/{peer}", seconds * 1000)
    except Exception:
        raise RuntimeError(
            f"torchacc.distributed.{name}: rank {me} waited {seconds} s for rank {peer}'s "
            f"matching {'recv' if me == source else 'send'} (transfer #{n + 1} from rank "
            f"{source} to rank {target}; {time.monotonic() - start:.0f} s)"
        ) from None
    if n >= 1:  # the peer read my previous post before it posted this one
        client.key_value_delete(f"{prefix}/{n - 1}/{me}")
    return theirs
