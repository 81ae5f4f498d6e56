"""Atomic training checkpoints: ``<dir>/checkpoint_<step>.pt``, written by rank 0.

A checkpoint is written to a temporary file in the same directory, flushed and fsync'ed, then
renamed over its final name with ``os.replace``: a reader never sees a half-written file, and a
crash mid-save leaves the previous checkpoint intact. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import os
import re
import tempfile

import torch

__all__ = ["save_checkpoint", "find_checkpoint", "load_checkpoint", "to_cpu", "atomic_write_bytes"]

_NAME = re.compile(r"^checkpoint_(\d+)\.pt$")


def to_cpu(obj):
    """A copy of nested containers with every tensor moved to the CPU (device tensors too)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _fsync_dir(path: str) -> None:
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


def atomic_write_bytes(path: str, write) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``, then rename it onto ``path``."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def save_checkpoint(directory: str, state: dict, step: int, keep: int = 2) -> str:
    path = os.path.join(directory, f"checkpoint_{step:08d}.pt")
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    if keep > 0:
        old = sorted(_list(directory))[:-keep]
        for _, name in old:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    return path


def _list(directory: str):
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            yield int(m.group(1)), name


def find_checkpoint(path: str) -> str:
    """``path`` itself if it is a file, else the newest checkpoint in the directory ``path``."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    found = sorted(_list(path))
    if not found:
        raise FileNotFoundError(f"no checkpoint_<step>.pt in {path!r}")
    return os.path.join(path, found[-1][1])


def load_checkpoint(path: str) -> dict:
    return torch.load(find_checkpoint(path), map_location="cpu", weights_only=False)
