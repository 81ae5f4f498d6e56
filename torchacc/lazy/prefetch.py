"""The one prefetch loop of the lazy frontend: a background thread iterates a host loader, starts
each batch's upload to the device and keeps up to ``prefetch`` uploaded batches ready, while the
recording thread takes them, wrapped as torchacc tensors. ``torchacc.AsyncLoader``
(torchacc/accel/loader.py) and torch_xla's ``ParallelLoader`` / ``MpDeviceLoader``
(torchacc/torch_xla/distributed/parallel_loader.py) are this loop with their own sync points.

The callers pass the upload (any thread) and the wrapping (the recording thread): the batch's
layout on the mesh is the sharding engine's, above this stage. An exception in the host loader is
re-raised in the consuming thread; ``close()`` stops the thread and drops what it prefetched.
"""

from __future__ import annotations

import queue
import threading

__all__ = ["END", "Prefetcher"]

END = object()  # what ``Prefetcher.get`` returns once the host loader is exhausted


class Prefetcher:
    """One pass over ``loader`` in a background thread named ``name``: each batch becomes
    ``upload(transform(batch))`` in the thread and ``wrap(...)`` in :meth:`get`. ``check(batch,
    done)``, when given, runs in the thread before each upload and once with ``None`` after the
    last batch (e.g. the processes agreeing on each batch); False stops the pass."""

    def __init__(
        self,
        loader,
        prefetch,
        *,
        upload,
        wrap,
        transform=None,
        check=None,
        name="torchacc-loader",
    ):
        from torchacc.runtime.device import jax_device

        jax_device()  # pick (and join a multi-process job for) the device on this thread
        self._loader = loader
        self._upload, self._wrap, self._transform = upload, wrap, transform
        self._check = check
        self._queue = queue.Queue(maxsize=max(1, int(prefetch)))
        self._done = threading.Event()
        self.finished = False  # the host loader's pass ended (not an error, not a close)
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def _put(self, item):
        while not self._done.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self):
        transform, upload, check = self._transform, self._upload, self._check
        try:
            for batch in self._loader:
                if transform is not None:
                    batch = transform(batch)
                if check is not None and not check(batch, self._done):
                    return
                if self._done.is_set() or not self._put(("batch", upload(batch))):
                    return
                if self._done.is_set():  # closed while this batch waited: draw no more
                    return
            if check is not None:
                check(None, self._done)
        except BaseException as e:  # re-raised in the consuming thread
            self._put(("error", e))
            return
        self._put(("end", None))

    def get(self):
        """The next batch on the device, or ``END``; re-raises the host loader's exception."""
        if self._done.is_set() and self._queue.empty():
            return END
        while True:
            try:
                kind, payload = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self._queue.empty():
                    return END
        if kind == "end":
            self._done.set()
            self.finished = True
            return END
        if kind == "error":
            self._done.set()
            raise payload
        return self._wrap(payload)

    def close(self):
        """Stop the background thread (batches not yet taken are dropped)."""
        self._done.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __del__(self):
        done = getattr(self, "_done", None)
        if done is not None:
            done.set()
