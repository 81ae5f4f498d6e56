"""Where in the user's code a sync, a compile or a fallback came from, in the user's words.

Note [Trigger sites]
A sync or a fallback is explained by the user's line that caused it: the innermost frame on the
stack whose file is not part of torchacc, torch, JAX or the standard library's ``contextlib``
(the gallery's trainer and the user's scripts and models count as the user's). Frames are
classified once per code object, so finding the site costs one walk over the stack's frames: that
is only done at syncs and fallbacks, never per recorded op (except with ``TORCHACC_DEBUG=1``,
which tags every recorded op with its line; ``torchacc/lazy/op_sites.py``).

A read of a pending tensor also says what kind of read it was. The internal frames between the
reader and the engine name it (``__repr__`` is ``print``, ``numpy`` is ``.numpy()``, ...); a
scalar read (``_local_scalar_dense``) is told apart by the instruction the reading frame was
executing: a conditional jump is control flow (``if loss > 0``), a call is ``.item()``,
``float(t)`` or ``bool(t)``, read from the call's source text.
"""

from __future__ import annotations

import bisect
import dis
import linecache
import os
import sys
import threading
import warnings

import jax
import torch

from torchacc.metrics import short_path

_TORCHACC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOTS = tuple(  # torchacc's first: describe_read tells torchacc's frames from torch's
    p + os.sep
    for p in [_TORCHACC, *(os.path.dirname(os.path.abspath(m.__file__)) for m in (torch, jax))]
)
_STDLIB_INTERNAL = ("contextlib.py",)
_internal: dict = {}  # code object -> True when it is torchacc/torch/jax code


def _is_internal(code):
    flag = _internal.get(code)
    if flag is None:
        path = code.co_filename
        flag = path.startswith(_ROOTS) or os.path.basename(path) in _STDLIB_INTERNAL
        if not flag and not path.startswith("<"):  # relative, or with "..": sys.path tricks
            flag = os.path.abspath(path).startswith(_ROOTS)
        _internal[code] = flag
    return flag


class Site:
    """A line of code: ``file``, ``line``, ``function``; ``str()`` is ``file:line``."""

    __slots__ = ("file", "line", "function")

    def __init__(self, file, line, function):
        self.file = file
        self.line = line
        self.function = function

    def __str__(self):
        return f"{short_path(self.file)}:{self.line}"

    def key(self):
        return (self.file, self.line)


def _site_of(frame):
    if frame is None:
        return Site("<unknown>", 0, "?")
    return Site(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def caller(depth=1):
    """The frame ``depth`` levels above the caller, or None (a thread with no Python caller)."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def main_thread_frame():
    """The main thread's current frame: where the user is while autograd's device thread runs
    a backward (``loss.backward()`` waits for it)."""
    return sys._current_frames().get(threading.main_thread().ident)


def user_frame(frame):
    """The innermost frame of the user's code at or above ``frame`` (None: this thread has no
    Python caller, so look at the main thread)."""
    f = frame if frame is not None else main_thread_frame()
    if f is None:
        return None
    last = f
    while f is not None:
        if not _is_internal(f.f_code):
            return f
        last = f
        f = f.f_back
    return last


def user_site(frame):
    """The user's line that ``frame`` runs for (Note [Trigger sites])."""
    return _site_of(user_frame(frame))


# Reads of a pending tensor, named by the internal function the read went through (the outermost
# one found wins: ``numpy`` calls ``cpu`` which reaches ``_to_copy``).
_READ_KINDS = {
    "__repr__": "print",
    "__format__": "format",
    "numpy": ".numpy()",
    "tolist": ".tolist()",
    "_to_copy": ".cpu()",
    "_copy_": "copy to a CPU tensor",
    "_local_scalar_dense": ".item()",
    "_equal": "torch.equal",
    "deepcopy": "copy.deepcopy",
    "__reduce_ex__": "torch.save",
    "_maybe_convert_to_cpu": "xm.save",
    "get_rng_state": "xm.get_rng_state",
    "fallback_handler": "fallback",
}


class Read:
    """A read of a pending tensor: its ``kind``, the user's ``site``, the reading ``expr`` (source
    text, when one line) and ``via``: the torch line that read, when it was not the user's."""

    __slots__ = ("kind", "site", "expr", "via")

    def __init__(self, kind, site, expr, via):
        self.kind = kind
        self.site = site
        self.expr = expr
        self.via = via

    def what(self):
        """``print(loss)``, ``loss > 0 (control flow (bool))``, ``.item()``."""
        if not self.expr:
            return self.kind
        word = self.kind.strip(".()")  # `float(t)` and `t.item()` say their kind already
        return f"`{self.expr}`" + ("" if word in self.expr else f" ({self.kind})")

    def describe(self):
        """``print(loss) at train.py:12`` / ``.item() in torch/optim/adam.py:40, from ...``."""
        what = self.what()
        if self.via is not None:
            return f"{what} in {self.via} (called from {self.site})"
        return f"{what} at {self.site}"


def describe_read(frame):
    """What read a pending tensor, and where (Note [Trigger sites])."""
    f = frame if frame is not None else main_thread_frame()
    kind, kind_frame, reader = "read", None, None
    while f is not None and _is_internal(f.f_code):
        name = f.f_code.co_name
        if name in _READ_KINDS:
            kind, kind_frame = _READ_KINDS[name], f
        if reader is None and not f.f_code.co_filename.startswith(_ROOTS[0]):
            reader = f  # the first frame outside torchacc: torch's code that read
        f = f.f_back
    if f is None:
        return Read(kind, Site("<unknown>", 0, "?"), None, None)
    reader = reader or f
    if kind == ".item()":
        kind = _scalar_read_kind(reader)
    elif kind == "fallback":
        func = kind_frame.f_locals.get("func")
        kind = f"fallback of {_op_name(func)} (no lowering)"
    via = None if reader is f else _site_of(reader)
    return Read(kind, _site_of(f), source_expr(f), via)


def _op_name(func):
    try:
        return func.name()
    except Exception:
        return str(func)


_JUMPS = ("POP_JUMP", "JUMP_IF", "TO_BOOL", "UNARY_NOT")
_instructions: dict = {}  # code object -> (sorted offsets, instructions)


def _instruction(frame):
    code = frame.f_code
    table = _instructions.get(code)
    if table is None:
        ins = list(dis.get_instructions(code))
        table = _instructions[code] = ([i.offset for i in ins], ins)
    offsets, ins = table
    at = bisect.bisect_right(offsets, frame.f_lasti) - 1
    return ins[at] if at >= 0 else None


def _scalar_read_kind(frame):
    """``.item()``, ``float()``, ``int()``, ``bool()`` or control flow (``if t:``)."""
    ins = _instruction(frame)
    if ins is None:
        return ".item()"
    if ins.opname.startswith(_JUMPS):
        return "bool in control flow"
    expr = source_expr(frame) or ""
    for builtin in ("float", "int", "bool"):
        if expr.startswith(builtin + "("):
            return builtin + "()"
    return ".item()"


def source_expr(frame, limit=60):
    """The source text of the expression ``frame`` is executing (one line, short), or None."""
    ins = _instruction(frame)
    pos = getattr(ins, "positions", None)
    if pos is None or pos.lineno is None or pos.lineno != pos.end_lineno:
        return None
    if pos.col_offset is None or pos.end_col_offset is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, pos.lineno)
    text = line.encode()[pos.col_offset : pos.end_col_offset].decode(errors="replace").strip()
    if not text or len(text) > limit or text.startswith(("if ", "while ", "assert ")):
        return None
    return text


def warn_at(site, message, category=UserWarning):
    """``warnings.warn`` as if raised at ``site`` (the user's line), honouring warning filters."""
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_filename == site.file and frame.f_lineno == site.line
    ):
        frame = frame.f_back
    module_globals = frame.f_globals if frame is not None else None
    if module_globals is not None:
        module = module_globals.get("__name__") or "__main__"
        registry = module_globals.setdefault("__warningregistry__", {})
    else:  # (warnings.warn_explicit's own default; an explicit None would match no filter)
        module = os.path.splitext(os.path.basename(site.file))[0] or "<unknown>"
        registry = None
    try:
        warnings.warn_explicit(
            message, category, site.file, site.line, module, registry, module_globals
        )
    except ImportError:  # a loader that cannot give the source (``python -c``, some REPLs)
        warnings.warn_explicit(message, category, site.file, site.line, module, registry)
