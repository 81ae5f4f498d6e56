"""``torchacc.AsyncLoader``: batches moved to the device ahead of the step, with bucketing.

::

    loader = ta.AsyncLoader(host_loader, ta.device(), buckets=[32, 64, 128])
    for batch in loader:          # on the device, padded to a bucket; one sync per batch
        loss = model(**batch).loss
        ...

A background thread iterates the host loader, pads each batch to its bucket and uploads its
tensors (``jax.device_put`` does not wait for the device), keeping up to ``prefetch`` batches
ready, as ``MpDeviceLoader`` does. Taking the next batch first runs ``torchacc.sync()``, so a loop
over the loader needs no ``mark_step``; the loader syncs once more when it is exhausted. Each
``iter()`` starts a new epoch over the host loader. The loader never splits data: a
``DistributedSampler`` in the host loader does; in a multi-process SPMD job each process's
batches are its share of a global batch (Note [Per-process batches] in sharding/data.py). On a
CPU/CUDA device (``backend='eager'``) the batches are bucketed and moved with ``.to(device)`` in
the consuming thread, with no sync.

Note [Bucketing]
XLA compiles one program per input shape, so variable-length batches would compile once per
length. Bucketing (TorchAcc's rule) pads each batch to one of a few lengths:

- the batch's length is the last dimension of its first key (batches must be dicts);
- it goes to the smallest bucket >= that length; every tensor key is right-padded on its last
  dimension with its ``pad_value_dict`` value (default ``{'input_ids': 0, 'attention_mask': 0,
  'labels': -100}``: padding is masked out and ignored by the loss);
- uniform buckets are ``max_length // num_buckets * (i + 1)`` for ``i < num_buckets``; given
  buckets are sorted;
- a batch longer than every bucket warns once naming its length and becomes a bucket of its own
  (later batches of that length or shorter than it reuse it);
- a tensor key missing from ``pad_value_dict`` is a ``ValueError`` naming it.

Note [Loader state]
``AsyncLoader.state_dict()`` is the position after the last batch the *consumer* took (never the
prefetched ones): the pass number, the batches taken in it, the buckets (grown ones included, so
a resumed run pads the same way) and the host loader's own state as it was right after it
produced that batch -- its ``state_dict()`` if it has one (a torchdata ``StatefulDataLoader``, the
gallery's loaders), or the ``state_dict()`` of a ``DataLoader``'s sampler when it loads in the
main process (``num_workers=0``: the sampler has then given out exactly the batches produced;
``torchacc.distributed.data_state.StatefulDistributedSampler``). ``load_state_dict`` restores
that host state, so the next pass starts at the next batch, on this or another data-parallel size
(Note [Data positions] in torchacc/distributed/data_state.py). A host loader with no state is
fast-forwarded instead: the next pass skips the batches already taken (same order needed: a
seeded sampler). A state of another loader or dataset is a ``DataStateError`` and changes nothing.

``TORCHACC_DEBUG=1`` prints each batch's original and bucket length, and each new step program's
memory (temp, argument, output bytes from its ``memory_analysis()``).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import os
import sys
import warnings

import torch
import torch.nn.functional as F

from torchacc.accel.config import DEFAULT_PAD_VALUES
from torchacc.distributed.data_state import (
    STATE_VERSION,
    DataStateError,
    check_state,
    load_with_source,
)
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.prefetch import END, Prefetcher
from torchacc.sharding import data
from torchacc.sharding.data import _map, upload_tree, wrap_tree  # noqa: F401  (shared uploads)


def uniform_buckets(max_length, num_buckets=8):
    """TorchAcc's uniform buckets: ``max_length // num_buckets * (i + 1)``."""
    if max_length // num_buckets < 1:
        raise ValueError(
            f"bucketing: max_length {max_length} is smaller than num_buckets {num_buckets}"
        )
    return [max_length // num_buckets * (i + 1) for i in range(num_buckets)]


def _debug():
    return os.environ.get("TORCHACC_DEBUG", "0").strip() not in ("", "0")


class Bucketing:
    """Pads dict batches to buckets (Note [Bucketing])."""

    def __init__(self, buckets=None, max_length=None, num_buckets=8, pad_value_dict=None):
        if buckets is None:
            buckets = uniform_buckets(max_length, num_buckets or 8)
        buckets = list(buckets)
        if not buckets or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets
        ):
            raise ValueError(f"bucketing: buckets must be positive ints, got {buckets}")
        if len(set(buckets)) != len(buckets):
            raise ValueError(f"bucketing: buckets hold a duplicate length: {buckets}")
        self.buckets = sorted(buckets)
        self.pad_value_dict = dict(DEFAULT_PAD_VALUES if pad_value_dict is None else pad_value_dict)

    def state_dict(self):
        return {"buckets": list(self.buckets)}

    def load_state_dict(self, state):
        self.buckets = sorted(state["buckets"])

    def bucket_of(self, length):
        """The smallest bucket >= ``length`` (a new one, with a warning, past the largest)."""
        i = bisect.bisect_left(self.buckets, length)
        if i == len(self.buckets):
            warnings.warn(
                f"torchacc bucketing: a batch of length {length} is longer than every bucket "
                f"(largest {self.buckets[-1]}); it gets a bucket of its own (one more compile)",
                stacklevel=3,
            )
            self.buckets.append(length)
            return length
        return self.buckets[i]

    def __call__(self, batch):
        if not isinstance(batch, dict) or not batch:
            raise ValueError(
                f"bucketing needs each batch to be a non-empty dict of tensors, got "
                f"{type(batch).__name__}"
            )
        first = next(iter(batch.values()))
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise ValueError(
                f"bucketing: the batch's first key {next(iter(batch))!r} must be a tensor with a "
                f"length dimension (its last)"
            )
        length = first.shape[-1]
        bucket = self.bucket_of(length)
        if _debug():
            print(f"torchacc: bucketing: batch length {length} -> bucket {bucket}", file=sys.stderr)
        out = type(batch)()
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                out[key] = value
                continue
            if key not in self.pad_value_dict:
                raise ValueError(
                    f"bucketing: batch key {key!r} has no pad value in pad_value_dict "
                    f"{self.pad_value_dict}"
                )
            if value.shape[-1] != length:
                raise ValueError(
                    f"bucketing: batch key {key!r} has length {value.shape[-1]} on its last "
                    f"dimension, the batch's first key has {length}"
                )
            pad = bucket - length
            out[key] = F.pad(value, (0, pad), value=self.pad_value_dict[key]) if pad else value
        return out


# --- moving batches to the torchacc device ------------------------------------------------------


def _to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    return _map(lambda v: _to_device(v, device), x)


_reported = [0]


def _report_new_programs():
    """``TORCHACC_DEBUG=1``: each newly built step program's memory by category (its
    ``memory_analysis()``): temp buffers (what gradient checkpointing lowers), arguments
    (parameters, optimizer state, the batch), the part of them donated to the results
    (``aliased``), results that take new memory (``outputs not donated``: what the script keeps,
    e.g. the logits), and the process's host memory (RSS now and its peak, Linux)."""
    from torchacc.program import cache

    programs = list(cache._cache.values())
    for exe in programs[_reported[0] :]:
        stats = getattr(exe, "memory_analysis", lambda: None)()
        if stats is not None:
            mib = 2**20
            alias = stats.alias_size_in_bytes
            print(
                f"torchacc: step program memory: temp {stats.temp_size_in_bytes / mib:.1f} MiB, "
                f"arguments {stats.argument_size_in_bytes / mib:.1f} MiB, outputs "
                f"{stats.output_size_in_bytes / mib:.1f} MiB, aliased {alias / mib:.1f} MiB, "
                f"outputs not donated {(stats.output_size_in_bytes - alias) / mib:.1f} MiB"
                f"{_host_memory()}",
                file=sys.stderr,
            )
    _reported[0] = len(programs)


def _host_memory():
    """``, host RSS x MiB (peak y MiB)`` from /proc/self/status, or nothing where it is absent."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        rss, hwm = (int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return ""
    return f", host RSS {rss:.0f} MiB (peak {hwm:.0f} MiB)"


class _Epoch:
    """One pass over the host loader, prefetched by the lazy frontend's loop
    (torchacc/lazy/prefetch.py); taking a batch first syncs the step recorded on the previous."""

    def __init__(self, loader, transform, prefetch, owner, input_sharding=None):
        from torchacc.runtime.device import jax_device

        jax_device()  # pick (and join a multi-process job for) the device on this thread
        layout = data.batch_layout(input_sharding)
        agreement = data.BatchAgreement()
        self._owner = owner
        # the host loader's batches come with its state after each (Note [Loader state]): the
        # loop carries (batch, state) pairs, the batch transformed, checked and uploaded
        self._prefetch = Prefetcher(
            owner._host_batches(),
            prefetch,
            upload=lambda item: (upload_tree(item[0], layout), item[1]),
            wrap=lambda item: item,  # wrapped in __next__, after the state is taken
            transform=lambda item: (transform(item[0]), item[1]),
            # the processes agree on each batch's shapes
            check=lambda item, done: agreement.check(None if item is None else item[0], done),
            name="torchacc-async-loader",
        )
        self._first = True
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self):
        from torchacc.engine.execute import sync

        if not self._first:
            sync()  # the step recorded on the previous batch
            if _debug():
                _report_new_programs()
        self._first = False
        item = self._prefetch.get()
        if item is END:
            if self._prefetch.finished and not self._ended:
                self._ended = True
                self._owner._ended()  # the host loader's pass is complete
            raise StopIteration
        batch, state = item
        self._owner._took(state)
        return wrap_tree(batch)

    def __del__(self):
        prefetch = getattr(self, "_prefetch", None)
        if prefetch is not None:
            prefetch._done.set()  # an abandoned epoch draws no more batches


def _host_sampler(loader):
    """The sampler whose state is a ``DataLoader``'s position (Note [Loader state]), or None."""
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.num_workers:
        return None
    sampler = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
    return sampler if hasattr(sampler, "state_dict") else None


def _stateful(obj):
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class AsyncLoader:
    """Wraps a host loader: its batches on ``device``, bucketed when ``buckets`` or ``max_length``
    is given (Note [Bucketing]); ``len()`` is the host loader's. ``prefetch``: batches uploaded
    ahead of the step. In SPMD mode ``input_sharding`` (an ``xs.ShardingSpec``, a dict of them
    per batch key, a ``NamedSharding`` or ``fn(tensor) -> NamedSharding``) lays the batch out as
    it is uploaded; with several processes each batch is this process's share of the global
    batch (Note [Per-process batches] in torchacc/sharding/data.py). ``state_dict()`` /
    ``load_state_dict()``: the position in the data (Note [Loader state])."""

    def __init__(
        self,
        loader,
        device,
        buckets=None,
        max_length=None,
        num_buckets=8,
        pad_value_dict=None,
        prefetch=4,
        input_sharding=None,
    ):
        self._loader = loader
        self.device = torch.device(device)
        self._prefetch = prefetch
        self._input_sharding = input_sharding
        self.bucketing = None
        if buckets is not None or max_length is not None:
            self.bucketing = Bucketing(buckets, max_length, num_buckets, pad_value_dict)
        self._pass = 0  # the pass the consumer is in (or the next one, when _ready)
        self._taken = 0  # batches the consumer took in that pass
        self._ready = True  # the next iter() starts pass _pass after _taken batches
        self._host = self._host_state()  # the host loader's state after the last batch taken
        self._skip = 0  # batches the next pass skips (a loaded state of a stateless loader)

    # -- state (Note [Loader state]) -----------------------------------------------------------

    def _state_source(self):
        if _stateful(self._loader):
            return self._loader
        return _host_sampler(self._loader)

    def _host_state(self):
        source = self._state_source()
        return None if source is None else source.state_dict()

    def _host_batches(self):
        """(batch, host state right after it) over one pass of the host loader."""
        skip, self._skip = self._skip, 0
        batches = iter(self._loader)
        if skip:
            batches = itertools.islice(batches, skip, None)
        for batch in batches:
            yield batch, self._host_state()

    def _took(self, host_state):
        self._taken += 1
        self._host = host_state

    def _ended(self):
        self._host = self._host_state()
        self._pass, self._taken, self._ready = self._pass + 1, 0, True

    def _length(self):
        try:
            return len(self._loader)
        except TypeError:
            return None

    def state_dict(self):
        """The position after the last batch taken (Note [Loader state])."""
        return {
            "kind": "AsyncLoader",
            "version": STATE_VERSION,
            "pass": self._pass,
            "batches": self._taken,
            "length": self._length(),
            "buckets": None if self.bucketing is None else list(self.bucketing.buckets),
            "host": copy.deepcopy(self._host),
        }

    def load_state_dict(self, state, source=None):
        """Continue after ``state``'s last batch: the next ``iter()`` yields the batch that
        followed it. Nothing changes if the state is another loader's or dataset's."""
        check_state(state, "AsyncLoader", {}, source)
        where = f"{source}: " if source else ""
        host, target = state.get("host"), self._state_source()
        if host is None and state.get("length") != self._length():
            raise DataStateError(
                f"{where}AsyncLoader state is for another dataset: it was saved on a host loader "
                f"of {state.get('length')} batches, this one has {self._length()}; nothing was "
                "changed"
            )
        if host is not None and target is None:
            raise DataStateError(
                f"{where}AsyncLoader state holds a host loader state ({host.get('kind', '?')}) "
                f"but this loader's host ({type(self._loader).__name__}) has none to load it "
                "into; nothing was changed"
            )
        if (state.get("buckets") is None) != (self.bucketing is None):
            raise DataStateError(
                f"{where}AsyncLoader state was saved with buckets {state.get('buckets')}, this "
                f"loader's are {self.buckets}; nothing was changed"
            )
        if host is not None:
            load_with_source(target, host, source)
            self._skip = 0
        else:
            self._skip = state["batches"]
        if self.bucketing is not None:
            self.bucketing.load_state_dict({"buckets": state["buckets"]})
        self._pass, self._taken, self._host = state["pass"], state["batches"], host
        self._ready = True

    @property
    def buckets(self):
        return None if self.bucketing is None else list(self.bucketing.buckets)

    def _transform(self, batch):
        return batch if self.bucketing is None else self.bucketing(batch)

    def __iter__(self):
        if not self._ready:  # a new pass after an unfinished one
            self._pass, self._taken = self._pass + 1, 0
        self._ready = False
        if self.device.type in (DEVICE_TYPE, "xla"):
            return _Epoch(self._loader, self._transform, self._prefetch, self, self._input_sharding)
        return self._eager()

    def _eager(self):
        for batch, state in self._host_batches():
            out = _to_device(self._transform(batch), self.device)
            self._took(state)
            yield out
        self._ended()

    def __len__(self):
        return len(self._loader)
