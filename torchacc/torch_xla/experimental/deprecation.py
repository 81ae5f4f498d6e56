"""``torch_xla.experimental.deprecation``: helpers that keep an old name working with a warning.

``deprecated(module, new, old_name)`` returns a function for ``module.old_name`` that logs a
warning naming both and calls ``new``; ``@mark_deprecated(new)`` turns the decorated function into
one that logs a warning and calls ``new`` instead.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


def deprecated(module, new, old_name=None):
    """A stand-in for ``module.<old_name>`` that warns and calls ``new``."""
    old = old_name or new.__name__
    where = getattr(module, "__name__", str(module))

    @functools.wraps(new)
    def wrapper(*args, **kwargs):
        logger.warning(
            "%s.%s is deprecated; use %s.%s instead",
            where,
            old,
            getattr(new, "__module__", where),
            getattr(new, "__name__", repr(new)),
        )
        return new(*args, **kwargs)

    return wrapper


def mark_deprecated(new):
    """Decorator: the decorated function warns (naming itself and ``new``) and calls ``new``."""

    def decorate(old):
        @functools.wraps(old)
        def wrapper(*args, **kwargs):
            logger.warning(
                "%s is deprecated; use %s instead",
                old.__name__,
                getattr(new, "__name__", repr(new)),
            )
            return new(*args, **kwargs)

        return wrapper

    return decorate


__all__ = ["deprecated", "mark_deprecated"]
