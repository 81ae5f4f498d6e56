"""Checkpointable data positions: samplers whose ``state_dict()`` is a place in a global order.

``StatefulDistributedSampler`` is ``torch.utils.data.DistributedSampler`` with torchdata's
``StatefulDataLoader`` convention (``state_dict()`` / ``load_state_dict()``); the gallery's
``EpochBatches``, ``torchacc.parallel.DistributedSampler`` and ``ta.AsyncLoader`` keep their
positions the same way (Note [Data positions]). ``check_state`` is the one check of a saved
state against the data it is loaded into.

Note [Data positions]
An epoch's order is one global permutation of the dataset's indices that depends only on (seed,
epoch) -- ``torch.utils.data.DistributedSampler``'s: ``randperm(n)`` from a generator seeded
``seed + epoch``, cut (``drop_last``) or padded by repeating its start to a multiple of the
number of shards. Shard ``s`` of ``W`` takes every ``W``-th index from ``s``. So after each shard
has taken ``k`` samples, the job has consumed exactly the first ``k * W`` entries of the order,
whatever ``W`` is. A saved position is that global count (``consumed``), never a per-shard one.
Loading it on ``W'`` shards re-splits the rest of the order, ``order[consumed:]``, every
``W'``-th from ``s``: on the same ``W`` that is exactly what the uninterrupted run takes; on
another ``W'`` it is what an uninterrupted ``W'`` run takes whenever ``consumed`` is a multiple of
``W'`` (a global batch of ``b * W = b' * W'`` samples makes it one), and in any case every sample
of the epoch is taken once, none twice. With ``drop_last`` every shard gets the same count (the
tail that does not split evenly is dropped, as torch drops it); without, the rest is padded from
its start.

A state names the data it belongs to (dataset length, seed, shuffle): loading it into other data
is a ``DataStateError`` naming the field, the two values and where the state came from, and
changes nothing.
"""

from __future__ import annotations

import math

import torch
import torch.utils.data

__all__ = [
    "DataStateError",
    "StatefulDistributedSampler",
    "check_state",
    "load_with_source",
    "epoch_order",
    "resplit",
]

STATE_VERSION = 1


class DataStateError(ValueError):
    """A saved data position that does not belong to the data it is loaded into."""


def epoch_order(n, seed, epoch, shuffle=True):
    """The epoch's global order of ``range(n)`` (Note [Data positions])."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def resplit(order, consumed, num_shards, shard_id, drop_last):
    """Shard ``shard_id``'s indices of the rest of ``order`` after ``consumed`` global samples,
    split over ``num_shards`` (Note [Data positions])."""
    n = len(order)
    if drop_last:
        total = n // num_shards * num_shards
        rest = order[min(consumed, total) : total]
    else:
        total = math.ceil(n / num_shards) * num_shards if n else 0
        padded = order + (order * math.ceil((total - n) / max(n, 1)))[: total - n]
        rest = padded[min(consumed, total) :]
        if len(rest) % num_shards:  # a position that does not split evenly: pad its tail
            pad = num_shards - len(rest) % num_shards
            rest = rest + (padded * math.ceil(pad / max(len(padded), 1)))[:pad]
    per = len(rest) // num_shards
    return rest[shard_id : per * num_shards : num_shards]


def check_state(state, kind, expected, source=None):
    """Raise a :class:`DataStateError` unless ``state`` is a ``kind`` state (a dict with
    ``"kind"`` and ``"version"``) whose fields in ``expected`` (name -> value here) are equal;
    ``source`` (a file, a checkpoint) is named in the message."""
    where = f"{source}: " if source else ""
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise DataStateError(
            f"{where}loader state of kind {got!r} cannot be loaded into a {kind}; nothing was "
            "changed"
        )
    version = state.get("version")
    if not isinstance(version, int) or version > STATE_VERSION:
        raise DataStateError(
            f"{where}{kind} state of format version {version!r}; this torchacc reads versions "
            f"<= {STATE_VERSION} (written by a newer torchacc?); nothing was changed"
        )
    for name, value in expected.items():
        if state.get(name) != value:
            raise DataStateError(
                f"{where}{kind} state is for another dataset: its {name} is "
                f"{state.get(name)!r}, this {kind}'s is {value!r}; nothing was changed"
            )


def load_with_source(obj, state, source):
    """``obj.load_state_dict(state)``, passing ``source`` (for its messages) if it takes one."""
    import inspect

    try:
        takes = "source" in inspect.signature(obj.load_state_dict).parameters
    except (TypeError, ValueError):
        takes = False
    return obj.load_state_dict(state, source=source) if takes else obj.load_state_dict(state)


class StatefulDistributedSampler(torch.utils.data.DistributedSampler):
    """``torch.utils.data.DistributedSampler`` (same arguments, same order) that can be saved and
    restored mid-epoch, also on another number of replicas (Note [Data positions]).

    ``state_dict()`` is the epoch and the global count of samples taken so far (``num_replicas``
    times this replica's count); ``load_state_dict(state)`` makes the next ``iter()`` of that
    epoch start there. ``set_epoch`` to another epoch drops a loaded position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.yielded = 0  # samples this replica took from the current iterator
        self._start = 0  # the global position the current iterator started at
        self._resume = None  # (epoch, consumed) from load_state_dict, for the next iter()

    def _fields(self):
        return {"dataset_len": len(self.dataset), "seed": self.seed, "shuffle": self.shuffle}

    def __iter__(self):
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None
        order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
        indices = resplit(order, start, self.num_replicas, self.rank, self.drop_last)
        self._start, self.yielded = start, 0
        for i in indices:
            self.yielded += 1
            yield i

    def state_dict(self):
        if self._resume is not None:
            epoch, consumed = self._resume
        else:
            epoch, consumed = self.epoch, self._start + self.yielded * self.num_replicas
        return {
            "kind": "StatefulDistributedSampler",
            "version": STATE_VERSION,
            "epoch": epoch,
            "consumed": consumed,
            **self._fields(),
        }

    def load_state_dict(self, state, source=None):
        check_state(state, "StatefulDistributedSampler", self._fields(), source)
        self.epoch = state["epoch"]
        self._resume = (state["epoch"], state["consumed"])
        self._start, self.yielded = state["consumed"], 0
