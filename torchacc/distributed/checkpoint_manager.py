"""Step-numbered, atomic distributed checkpoints: torch_xla's ``CheckpointManager`` on torchacc.

``CheckpointManager(path, save_interval, max_to_keep=0)`` keeps one DCP checkpoint per saved step
under ``path/<step>`` (written by :mod:`torchacc.distributed.checkpoint`'s planners), restores
any tracked step into a state dict in place, and deletes the oldest beyond ``max_to_keep``.

Note [Atomic checkpoints]
A checkpoint directory is never written in place. Every process writes its shards into
``path/.tmp-<step>``; once DCP's save returned on every process (its last collective means every
process's files and the coordinator's ``.metadata`` are complete), the coordinator writes the
manager's own ``.manager_metadata`` (JSON: step and time; no pickle) into it and renames it to
``path/<step>`` (an existing ``<step>`` is first renamed aside to a ``.tmp-`` name, then
removed). A crash or an
exception at any point before the rename leaves only a ``.tmp-`` directory, which is ignored
(and removed by the next save of that step): the previous checkpoints stay loadable. Only
directories named by a step that hold both metadata files are tracked; the ``.tmp-`` ones (a save
that did not finish: a crash, a ``kill -9`` of a rank or of the launcher) are named in a warning
when the manager starts, and removed by the next save of their step.

Note [Checkpoint contents]
Besides tensors, a state dict may hold *stateful* objects (``state_dict()`` and
``load_state_dict()``: a ``ta.AsyncLoader``, a sampler, an optimizer), DCP's ``Stateful``
convention: a save writes their ``state_dict()``. ``restore`` checks everything it can before it
changes anything, and names the checkpoint directory in each error (``CheckpointError``): the
format version in ``.manager_metadata`` (a newer one is refused), that every data file
``.metadata`` refers to is there and long enough (a directory holding only some ranks' files),
the tensor names and shapes (within each top-level entry the target has, the keys must be the
checkpoint's exactly; top-level entries it lacks are not read). Then the stateful objects' saved
states are read and loaded (each one checks its own, e.g. a loader state of another dataset);
then the tensors, all or nothing. If the tensor read fails, the stateful objects get their states
from before the restore back: a failed restore changes nothing.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from torchacc.distributed import checkpoint as engine
from torchacc.distributed.data_state import load_with_source

MANAGER_METADATA = ".manager_metadata"
_TMP = ".tmp-"
# The layout this manager writes (Note [Checkpoint contents]); a reader refuses newer ones.
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored into this state; the message names its directory."""


class RNGState:
    """The random streams of this process as a stateful checkpoint entry (``{"rng":
    RNGState()}``): the torchacc device's generator and the CPU generator. Restored, dropout
    and other random ops continue the saved run's streams (the same layout: one process's
    streams are not split over another number of processes). In a job of several processes
    each rank saves and restores its own entry (``rank<r>``). ``device=False``: the CPU
    generator only (the eager path, torch's own devices: nothing of the torchacc device is
    touched)."""

    def __init__(self, device=True):
        self.device = device

    def _rank(self):
        return dist.get_rank() if _distributed() else 0

    def state_dict(self):
        mine = {"cpu": torch.get_rng_state()}
        if self.device:
            from torchacc.engine.execute import fetch
            from torchacc.lazy import random as device_rng

            words = fetch(device_rng.state_value(), torch.uint32).tolist()
            mine["device"] = (int(words[0]) << 32) | int(words[1])
        return {"kind": "RNGState", f"rank{self._rank()}": mine}

    def load_state_dict(self, state, source=None):
        from torchacc.lazy import random as device_rng

        mine = state.get(f"rank{self._rank()}") if isinstance(state, dict) else None
        if mine is None:
            where = f"{source}: " if source else ""
            raise CheckpointError(
                f"{where}no RNG state of rank {self._rank()} (saved: "
                f"{sorted(k for k in state if k.startswith('rank'))}); RNG streams resume only on "
                "the layout that saved them"
            )
        if self.device and "device" not in mine:
            where = f"{source}: " if source else ""
            raise CheckpointError(
                f"{where}the saved RNG state of rank {self._rank()} has no torchacc device "
                "stream (saved with RNGState(device=False)); restore it with device=False"
            )
        torch.set_rng_state(mine["cpu"])
        if self.device:
            device_rng.manual_seed(int(mine["device"]))


def _is_stateful(v):
    # tensors first: the Stateful protocol check is slow (inspect.getattr_static), and a state
    # dict is mostly tensors
    return not isinstance(v, torch.Tensor) and isinstance(v, Stateful)


def resolve_stateful(state_dict):
    """``state_dict`` (nested dicts) with each stateful object replaced by its ``state_dict()``,
    and the paths of those objects (a tuple of keys each)."""
    found = []

    def walk(d, path):
        """``d`` itself when nothing in it is stateful (DCP then loads into the caller's own
        dicts), else a copy."""
        out, changed = {}, False
        for k, v in d.items():
            if _is_stateful(v):
                found.append((path + (k,), v))
                out[k], changed = _containers_copied(v.state_dict()), True
            elif isinstance(v, dict):
                out[k] = walk(v, path + (k,))
                changed = changed or out[k] is not v
            else:
                out[k] = v
        return out if changed else d

    return walk(state_dict, ()), found


def _containers_copied(x):
    """``x`` with its dicts and lists copied (a load fills the copy, never the object's own
    state); tensors and other leaves are shared."""
    if isinstance(x, dict):
        return {k: _containers_copied(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_containers_copied(v) for v in x]
    return x


def _get(d, path):
    for k in path:
        d = d[k]
    return d


def _load_stateful(obj, state, source):
    if isinstance(obj, torch.nn.Module):
        return  # its tensors were loaded in place
    load_with_source(obj, state, source)


def _distributed():
    return dist.is_available() and dist.is_initialized()


class CheckpointManager:
    """Checkpoints every ``save_interval`` steps into ``path`` (see the module docstring).

    ``process_group``: the group DCP coordinates through (default: the default group when
    ``torch.distributed`` is initialized; a single process needs none). ``max_pending_async``
    bounds the asynchronous saves in flight; their writer thread runs ``writer_nice`` below the
    training's priority (Note [Asynchronous saves] in checkpoint.py; 0: the same).
    ``chkpt_on_preemption`` (torch_xla's preemption sync) is not supported: passing True raises.
    """

    def __init__(
        self,
        path,
        save_interval,
        max_to_keep=0,
        max_pending_async=1,
        num_of_threads=1,
        process_group=None,
        chkpt_on_preemption=False,
        writer_nice=10,
    ):
        if not isinstance(save_interval, int) or save_interval <= 0:
            raise ValueError(
                f"CheckpointManager: save_interval must be positive, got {save_interval!r}"
            )
        if max_to_keep is None or max_to_keep < 0:
            raise ValueError(f"CheckpointManager: max_to_keep must be >= 0, got {max_to_keep!r}")
        if max_pending_async is None or max_pending_async <= 0:
            raise ValueError(
                f"CheckpointManager: max_pending_async must be positive, got {max_pending_async!r}"
            )
        if not isinstance(writer_nice, int) or not 0 <= writer_nice <= 19:
            raise ValueError(
                f"CheckpointManager: writer_nice must be in 0..19, got {writer_nice!r}"
            )
        if chkpt_on_preemption:
            raise NotImplementedError(
                "CheckpointManager(chkpt_on_preemption=True): torchacc has no preemption sync "
                "point; call save(step, state_dict, force=True) from your own SIGTERM handling"
            )
        self.base_path = os.fspath(path)
        self.save_interval = save_interval
        self.max_to_keep = max_to_keep
        self.num_of_threads = num_of_threads
        self.chkpt_on_preemption = False
        self.pg = process_group
        self.writer_nice = writer_nice
        nice = writer_nice if os.uname().sysname == "Linux" else 0  # elsewhere: per process
        self._pool = ThreadPoolExecutor(max_workers=1, initializer=os.nice, initargs=(nice,))
        self._async_sem = threading.Semaphore(max_pending_async)
        self._futures = []
        self._save_mutex = threading.Lock()
        if self._rank() == 0:
            os.makedirs(self.base_path, exist_ok=True)
        self._barrier()
        self._tracked = self._load_tracked()

    # -- the job ---------------------------------------------------------------------------

    def _rank(self):
        return dist.get_rank(self.pg) if _distributed() else 0

    def _barrier(self):
        if _distributed():
            dist.barrier(self.pg)

    def _dcp_kwargs(self):
        if _distributed():
            return {"process_group": self.pg}
        return {"no_dist": True}

    def _dcp(self, call, state_dict, **kwargs):
        """``dcp.save``/``dcp.load`` over the job (one process: no process group, quietly)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            call(state_dict, **kwargs, **self._dcp_kwargs())

    # -- tracked checkpoints ---------------------------------------------------------------

    def _path(self, step):
        return os.path.join(self.base_path, str(step))

    def _load_tracked(self):
        found, ignored, incomplete = [], [], []
        for name in sorted(os.listdir(self.base_path)):
            full = os.path.join(self.base_path, name)
            if not os.path.isdir(full):
                continue
            if name.startswith(_TMP):
                incomplete.append(name)
                continue
            try:
                with open(os.path.join(full, MANAGER_METADATA)) as f:
                    meta = json.load(f)
                if int(name) != meta["step"] or not os.path.exists(os.path.join(full, ".metadata")):
                    raise ValueError(name)
                found.append((float(meta["ts"]), int(meta["step"])))
            except (OSError, ValueError, KeyError, TypeError):
                ignored.append(name)
        if ignored:
            logging.warning("CheckpointManager: ignoring invalid checkpoints %s", ignored)
        if incomplete:
            logging.warning(
                "CheckpointManager: skipping incomplete checkpoints (saves that did not finish) "
                "in %s: %s",
                self.base_path,
                incomplete,
            )
        self.incomplete = incomplete
        return [step for _, step in sorted(found)]

    def latest_step(self):
        """The newest step with a complete checkpoint, or None."""
        return max(self._tracked) if self._tracked else None

    def all_steps(self):
        """Every step with a complete checkpoint, ascending."""
        return sorted(self._tracked)

    def _release_oldest(self):
        if self.max_to_keep <= 0:
            return
        while len(self._tracked) > self.max_to_keep:
            step = self._tracked.pop(0)
            if self._rank() == 0:
                shutil.rmtree(self._path(step), ignore_errors=True)

    # -- saving ----------------------------------------------------------------------------

    def reached_preemption(self, step):
        """torch_xla's preemption sync point: not available (see the class docstring)."""
        raise NotImplementedError(
            "CheckpointManager.reached_preemption: torchacc has no preemption sync point "
            "(chkpt_on_preemption is not supported)"
        )

    def should_save(self, step):
        """Whether ``step`` is a checkpoint step (a multiple of ``save_interval``)."""
        return step % self.save_interval == 0

    def _save(self, step, state_dict):
        """Write ``state_dict`` as the checkpoint of ``step`` (Note [Atomic checkpoints])."""
        with self._save_mutex:
            tmp = os.path.join(self.base_path, f"{_TMP}{step}")
            if self._rank() == 0 and os.path.exists(tmp):
                shutil.rmtree(tmp)
            self._barrier()
            self._dcp(
                dcp.save,
                state_dict,
                storage_writer=dcp.FileSystemWriter(tmp, thread_count=self.num_of_threads),
                planner=engine.SPMDSavePlanner(),
            )
            if self._rank() == 0:
                _commit(tmp, self._path(step), step)
                _sweep_incomplete(self.base_path, step)
            self._barrier()
            if step in self._tracked:
                self._tracked.remove(step)
            self._tracked.append(step)
            self._release_oldest()

    def save(self, step, state_dict, force=False):
        """Checkpoint ``state_dict`` now if ``should_save(step)`` (or ``force``); returns
        whether it did."""
        if not (force or self.should_save(step)):
            return False
        self._save(step, resolve_stateful(state_dict)[0])
        return True

    def save_async(self, step, state_dict, force=False):
        """Like :meth:`save`, but writes in a background thread while training goes on: this
        process's unique shards are first copied on their devices and read to the host block by
        block as they are written (Note [Asynchronous saves] in checkpoint.py). Waits, before
        copying, while ``max_pending_async`` saves are in flight; :meth:`join` waits for them."""
        if not (force or self.should_save(step)):
            return False
        # the slot first, then the copy: at most max_pending_async copies exist at a time. The
        # slot is given back only once the writer dropped its copy (not when its future is done:
        # the pool's work item still holds its arguments then, and the next save's copy would
        # briefly make two)
        self._async_sem.acquire()
        try:
            box = [engine.snapshot(resolve_stateful(state_dict)[0], on_device=True)]
            future = self._pool.submit(self._write_and_release, step, box)
        except BaseException:
            self._async_sem.release()
            raise
        self._futures.append(future)
        return True

    def _write_and_release(self, step, box):
        try:
            self._save(step, box.pop())
        finally:
            gc.collect()  # DCP's planners may hold the copy in reference cycles
            self._async_sem.release()

    def join(self):
        """Wait for the pending asynchronous saves; re-raises the first one's error."""
        futures, self._futures = self._futures, []
        wait(futures)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()

    # -- loading ---------------------------------------------------------------------------

    def restore(self, step, state_dict):
        """Load the checkpoint of ``step`` into ``state_dict`` in place (torchacc tensors keep
        their current sharding; stateful objects get their saved states). Everything that can
        be checked is checked first and a failure is a :class:`CheckpointError` naming the
        directory, with nothing changed (Note [Checkpoint contents])."""
        if step not in self._tracked:
            raise ValueError(
                f"CheckpointManager.restore: no checkpoint of step {step} in {self.base_path} "
                f"(tracked steps: {self.all_steps()})"
            )
        path = self._path(step)
        metadata = check_checkpoint(path)
        resolved, stateful = resolve_stateful(state_dict)
        try:
            check_keys(resolved, metadata, subset={keys[0] for keys, _ in stateful})
            engine.check_state_dict(resolved, metadata)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        # the stateful objects' saved states first (each checks its own), then the tensors
        plain = {k: v for k, v in resolved.items() if not _has_tensor(v)}
        if plain:
            self._dcp(
                dcp.load,
                plain,
                storage_reader=engine.SafeFileSystemReader(path),
                planner=engine.SPMDLoadPlanner(),
            )
        before = []
        try:
            for keys, obj in stateful:
                if isinstance(obj, torch.nn.Module) or _has_tensor(_get(resolved, keys)):
                    continue
                old = obj.state_dict()
                _load_stateful(obj, _get(plain, keys), path)
                before.append((obj, old))
            tensors = {k: v for k, v in resolved.items() if k not in plain}
            if tensors:
                self._dcp(
                    dcp.load,
                    tensors,
                    storage_reader=engine.SafeFileSystemReader(path),
                    planner=engine.SPMDLoadPlanner(all_or_nothing=True),
                )
            for keys, obj in stateful:
                if keys[0] in tensors and not isinstance(obj, torch.nn.Module):
                    _load_stateful(obj, _get(tensors, keys), path)
        except BaseException:
            for obj, old in reversed(before):
                _load_stateful(obj, old, None)
            raise
        for k, v in plain.items():
            if not any(keys[0] == k for keys, _ in stateful):
                state_dict[k] = v  # a plain value (an int, a dict of them) read back


def _has_tensor(v):
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def check_checkpoint(path):
    """The DCP metadata of the checkpoint directory ``path`` after checking what can be checked
    without the target: the format version, the metadata's safety, every data file present
    and long enough. A :class:`CheckpointError` naming ``path`` otherwise."""
    try:
        with open(os.path.join(path, MANAGER_METADATA)) as f:
            manager = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable {MANAGER_METADATA} ({e})") from None
    version = manager.get("format", 1) if isinstance(manager, dict) else None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version!r} was written by a newer torchacc; "
            f"this one reads versions <= {FORMAT_VERSION}"
        )
    try:
        metadata = engine.SafeFileSystemReader(path).read_metadata()
    except Exception as e:  # the unpickler's refusal or a damaged file: one line
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: its .metadata cannot be read ({why})") from None
    need = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        need[name] = max(need.get(name, 0), info.offset + info.length)
    missing, short = [], []
    for name, size in sorted(need.items()):
        try:
            have = os.path.getsize(os.path.join(path, name))
        except OSError:
            missing.append(name)
            continue
        if have < size:
            short.append(f"{name} ({have} of {size} bytes)")
    if missing or short:
        what = []
        if missing:
            what.append(f"missing {len(missing)} of {len(need)} data files ({', '.join(missing)})")
        if short:
            what.append(f"truncated: {', '.join(short)}")
        raise CheckpointError(
            f"{path}: incomplete checkpoint: {'; '.join(what)} (only some ranks' files were "
            "copied, or a save was cut short)"
        )
    return metadata


def check_keys(state_dict, metadata, subset=()):
    """Within each top-level entry of ``state_dict``, its flat keys must be the checkpoint's
    (a checkpoint of another model); top-level entries it lacks are not read. An entry in
    ``subset`` (a stateful object's, which checks its own state) may have fewer keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    saved = set(metadata.state_dict_metadata)
    for top in state_dict:
        ours = {k for k in flat if k == top or k.startswith(f"{top}.")}
        theirs = {k for k in saved if k == top or k.startswith(f"{top}.")}
        if ours == theirs:
            continue
        missing, extra = sorted(ours - theirs), sorted(theirs - ours)
        if top in subset and not missing:
            continue
        parts = []
        if missing:
            parts.append(f"{len(missing)} keys missing in the checkpoint (e.g. {missing[0]!r})")
        if extra:
            parts.append(f"{len(extra)} keys only in the checkpoint (e.g. {extra[0]!r})")
        raise ValueError(
            f"{top!r} is not what the checkpoint holds: {'; '.join(parts)} (a checkpoint of "
            "another model, or an optimizer with no state yet: prime_optimizer); nothing was "
            "loaded"
        )


def _sweep_incomplete(base, step):
    """Remove the leftovers of unfinished saves of steps older than ``step``."""
    for name in os.listdir(base):
        if name.startswith(_TMP):
            tail = name[len(_TMP) :]
            if tail.isdigit() and int(tail) < step:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _commit(tmp, final, step):
    """Make the complete checkpoint ``tmp`` the checkpoint ``final`` (one rename)."""
    meta = os.path.join(tmp, MANAGER_METADATA)
    with open(meta + ".part", "w") as f:
        json.dump({"step": step, "ts": time.time(), "format": FORMAT_VERSION}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(meta + ".part", meta)
    old = None
    if os.path.exists(final):
        old = os.path.join(os.path.dirname(final), f"{_TMP}old-{step}-{time.time_ns()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
