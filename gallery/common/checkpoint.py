"""Atomic training checkpoints: ``<dir>/checkpoint_<step>.pt``, written by rank 0.

A checkpoint is written to a temporary file in the same directory, flushed and fsync'ed, then
renamed over its final name with ``os.replace``: a reader never sees a half-written file, and a
crash mid-save leaves the previous checkpoint intact. The newest ``keep`` checkpoints are kept.

Loading never runs code: ``torch.load(weights_only=True)`` with an allowlist of exactly the types
the trainer saves (:data:`SAFE_GLOBALS`: tensors, dicts, lists, tuples, strings, numbers, None
and bools need nothing beyond torch's own list, so it is empty). A file that holds anything else
is refused (:class:`UnsafeCheckpointError`); a file that is not a checkpoint, or a damaged one,
raises :class:`CheckpointError` with one line naming it. In a directory, a damaged newest
checkpoint is skipped with a warning in favour of the newest good one (two are kept for this).
Each file records ``format_version`` (:data:`FORMAT_VERSION`); one written by a newer version is
refused with a message naming the file, never half-read.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
import zipfile

import torch

__all__ = [
    "SAFE_GLOBALS",
    "CheckpointError",
    "UnsafeCheckpointError",
    "NewerCheckpointError",
    "save_checkpoint",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "resolve_checkpoint",
    "state_mismatch",
    "state_nbytes",
    "save_failure_line",
    "to_cpu",
    "atomic_write_bytes",
]

# Globals beyond torch's weights_only defaults that a gallery checkpoint may hold: none.
SAFE_GLOBALS: tuple = ()
# The layout of a checkpoint file this code writes; files of a newer one are refused.
FORMAT_VERSION = 1
_REQUIRED = ("model", "optimizer", "step")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


class NewerCheckpointError(CheckpointError):
    """A checkpoint written by a newer format version (refused, not skipped as damaged)."""


class UnsafeCheckpointError(CheckpointError):
    """A file whose unpickling would build objects a checkpoint never holds (e.g. call code)."""


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
    state = {**state, "format_version": FORMAT_VERSION}
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


def list_checkpoints(directory: str) -> list[str]:
    """The ``checkpoint_<step>.pt`` files of ``directory``, newest first."""
    return [os.path.join(directory, name) for _, name in sorted(_list(directory), reverse=True)]


def find_checkpoint(path: str) -> str:
    """``path`` itself if it is a file, else the newest checkpoint in the directory ``path``."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no checkpoint_<step>.pt in {path!r}")
    return found[0]


def _refusal(exc: BaseException) -> str:
    m = re.search(
        r"(unsupported GLOBAL \S+|Unsupported global: GLOBAL \S+|Unsupported operand \S+)", str(exc)
    )
    return m.group(1) if m else str(exc).strip().splitlines()[0][:200]


def load_checkpoint(path: str, *, mmap: bool = False) -> dict:
    """Load one checkpoint file safely (see the module docstring); ``mmap=True`` only checks it
    cheaply (tensor data stays on disk). A directory means its newest good checkpoint."""
    if os.path.isdir(path):
        path = resolve_checkpoint(path)[0]
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: not a checkpoint (not a torch.save archive; damaged or another kind of file)"
        )
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: it holds objects a checkpoint never does ({_refusal(e)}); "
            "checkpoints are loaded with weights_only=True and never run code"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{path}: damaged or not a checkpoint ({_refusal(e)})") from None
    if not isinstance(state, dict) or not all(k in state for k in _REQUIRED):
        keys = sorted(state)[:6] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path}: not a training checkpoint of this trainer (expected keys "
            f"{', '.join(_REQUIRED)}; found {keys})"
        )
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise NewerCheckpointError(
            f"{path}: checkpoint format version {version!r} was written by a newer torchacc; "
            f"this one reads versions <= {FORMAT_VERSION}"
        )
    return state


def resolve_checkpoint(path: str, warn=None) -> tuple[str, dict]:
    """(file, state loaded with ``mmap=True``) for ``--resume path``: a file, or the newest good
    checkpoint of a directory. ``warn(line)`` hears about each damaged newer one skipped."""
    if not os.path.isdir(path):
        return path, load_checkpoint(path, mmap=True)
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: no checkpoint_<step>.pt in this directory")
    problems = []
    for file in found:
        try:
            state = load_checkpoint(file, mmap=True)
        except (UnsafeCheckpointError, NewerCheckpointError):
            raise
        except CheckpointError as e:
            problems.append(str(e))
            if warn is not None:
                warn(f"warning: skipping damaged checkpoint {e}; trying an older one")
            continue
        return file, state
    raise CheckpointError(f"{path}: no loadable checkpoint ({'; '.join(problems)})")


def state_mismatch(expected: dict, found: dict, what: str = "model") -> str | None:
    """What differs between two state dicts (names and shapes), in one phrase; None if they fit."""
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    shapes = [
        f"{k} {tuple(found[k].shape)} in the checkpoint vs {tuple(v.shape)} here"
        for k, v in expected.items()
        if k in found and hasattr(v, "shape") and tuple(found[k].shape) != tuple(v.shape)
    ]
    parts = []
    if missing:
        parts.append(f"{len(missing)} {what} entries missing (e.g. {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} unexpected (e.g. {extra[0]})")
    if shapes:
        parts.append(
            f"shape of {shapes[0]}" + (f" (+{len(shapes) - 1} more)" if shapes[1:] else "")
        )
    return "; ".join(parts) or None


def state_nbytes(obj) -> int:
    """Bytes of tensor data in nested containers (what a save writes, give or take metadata)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def save_failure_line(directory: str, step: int, exc: BaseException, need: int) -> str:
    """One line for a checkpoint that could not be written: directory, bytes needed and free."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if isinstance(exc, OSError) and exc.strerror:
        why = exc.strerror
    elif free is not None and free < need:
        why = "no space left on device"
    else:
        why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    room = f"needs ~{_mib(need)}, {_mib(free)} free" if free is not None else f"needs ~{_mib(need)}"
    kept = list_checkpoints(directory) if os.path.isdir(directory) else []
    keep = f"; kept {os.path.basename(kept[0])}" if kept else "; no older checkpoint there"
    return f"checkpoint of step {step} NOT saved in {directory}: {why} ({room}){keep}"
