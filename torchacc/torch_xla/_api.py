"""Markers for the torch_xla API surface: what works, what differs, what is not implemented.

Every torch_xla name that torchacc cannot honour exists anyway and raises ``NotImplementedError``
with the reason (never ``AttributeError``/``ModuleNotFoundError``): :func:`not_implemented` makes
such functions, :func:`not_implemented_class` such classes. A name that works but differs from
torch_xla carries its note (:func:`differs`). ``torchacc/torch_xla/_coverage.py`` reads these marks
to generate the README's coverage table, so the table follows the code.
"""

from __future__ import annotations

STATUS_ATTR = "__torchacc_status__"  # ("not implemented", reason) or ("differs", note)


def not_implemented(qualname, reason):
    """A function that raises ``NotImplementedError("<qualname>: <reason>")``."""

    def unsupported(*args, **kwargs):
        raise NotImplementedError(f"{qualname}: {reason}")

    unsupported.__name__ = qualname.rsplit(".", 1)[-1]
    unsupported.__qualname__ = unsupported.__name__
    unsupported.__doc__ = f"Not implemented on torchacc: {reason}"
    setattr(unsupported, STATUS_ATTR, ("not implemented", reason))
    return unsupported


def not_implemented_class(qualname, reason, bases=(object,)):
    """A class whose construction raises ``NotImplementedError("<qualname>: <reason>")``."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{qualname}: {reason}")

    name = qualname.rsplit(".", 1)[-1]
    return type(
        name,
        bases,
        {
            "__init__": __init__,
            "__doc__": f"Not implemented on torchacc: {reason}",
            STATUS_ATTR: ("not implemented", reason),
        },
    )


def differs(note):
    """Mark a working function or class that differs from torch_xla (``note`` says how)."""

    def mark(obj):
        setattr(obj, STATUS_ATTR, ("differs", note))
        return obj

    return mark


def status_of(obj):
    """``("works", "")``, ``("differs", note)`` or ``("not implemented", reason)``."""
    status = getattr(obj, STATUS_ATTR, None) if obj is not None else None
    if isinstance(status, tuple) and len(status) == 2:
        return status
    return ("works", "")
