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
directories named by a step that hold both metadata files are tracked.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchacc.distributed import checkpoint as engine

MANAGER_METADATA = ".manager_metadata"
_TMP = ".tmp-"


def _distributed():
    return dist.is_available() and dist.is_initialized()


class CheckpointManager:
    """Checkpoints every ``save_interval`` steps into ``path`` (see the module docstring).

    ``process_group``: the group DCP coordinates through (default: the default group when
    ``torch.distributed`` is initialized; a single process needs none). ``max_pending_async``
    bounds the asynchronous saves in flight. ``chkpt_on_preemption`` (torch_xla's preemption
    sync through its coordinator) is not supported: passing True raises.
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
        self._pool = ThreadPoolExecutor(max_workers=1)
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
        found, ignored = [], []
        for name in sorted(os.listdir(self.base_path)):
            full = os.path.join(self.base_path, name)
            if not os.path.isdir(full) or name.startswith(_TMP):
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
        return [step for _, step in sorted(found)]

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
        self._save(step, state_dict)
        return True

    def save_async(self, step, state_dict, force=False):
        """Like :meth:`save`, but writes in a background thread: the state is first copied to
        the host (this process's unique shards), so training may go on. Blocks while
        ``max_pending_async`` saves are in flight; :meth:`join` waits for them."""
        if not (force or self.should_save(step)):
            return False
        host = engine.snapshot(state_dict)
        self._async_sem.acquire()
        try:
            future = self._pool.submit(self._save, step, host)
        except BaseException:
            self._async_sem.release()
            raise
        future.add_done_callback(lambda _: self._async_sem.release())
        self._futures.append(future)
        return True

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
        their current sharding). Raises a ``ValueError`` naming the tensor, before anything is
        changed, if a shape differs from the checkpoint's; a read that fails leaves every
        torchacc tensor as it was (``SPMDLoadPlanner(all_or_nothing=True)``)."""
        if step not in self._tracked:
            raise ValueError(
                f"CheckpointManager.restore: no checkpoint of step {step} in {self.base_path} "
                f"(tracked steps: {self.all_steps()})"
            )
        path = self._path(step)
        reader = engine.SafeFileSystemReader(path)
        engine.check_state_dict(state_dict, reader.read_metadata())
        self._dcp(
            dcp.load,
            state_dict,
            storage_reader=engine.SafeFileSystemReader(path),
            planner=engine.SPMDLoadPlanner(all_or_nothing=True),
        )


def _commit(tmp, final, step):
    """Make the complete checkpoint ``tmp`` the checkpoint ``final`` (one rename)."""
    meta = os.path.join(tmp, MANAGER_METADATA)
    with open(meta + ".part", "w") as f:
        json.dump({"step": step, "ts": time.time()}, f)
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
