"""Old spellings that keep working for one release, each with a DeprecationWarning that names the
new one: a renamed keyword argument (`renamed_keyword`), option key (`rename_key`) or value
(`renamed_value`), and a name moved to another module (`moved_names`, a module `__getattr__`).

Each warning points at the first caller outside this package (and the JAX and Flax frames
that call it: a traced function, a module's constructor), so it shows where the old spelling is
written.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from typing import Any, Callable, Mapping

_PASSED_OVER = frozenset({__name__.split(".")[0], "jax", "jaxlib", "flax"})


def _stacklevel() -> int:
    """The stack level of the first frame outside `_PASSED_OVER` (for `warnings.warn`)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _PASSED_OVER:
        frame, level = frame.f_back, level + 1
    return level


def warn(old: str, new: str, *, where: str = "") -> None:
    """A DeprecationWarning: `old` is spelled `new` now (`where`: the prefix naming the caller)."""
    prefix = f"{where}: " if where else ""
    warnings.warn(
        f"{prefix}{old} is deprecated and will be removed in the next release; use {new}.",
        DeprecationWarning,
        stacklevel=_stacklevel(),
    )


def rename_key(mapping: Mapping[str, Any], old: str, new: str, *, where: str) -> dict:
    """`mapping` with its key `old` renamed `new` (a DeprecationWarning); both given: a
    ValueError naming both."""
    if new in mapping:
        raise ValueError(f"{where}: {old!r} is the deprecated spelling of {new!r}; give {new!r} alone.")
    warn(repr(old), repr(new), where=where)
    return {(new if key == old else key): value for key, value in mapping.items()}


def renamed_keyword(old: str, new: str) -> Callable:
    """Decorator: the keyword argument `old` is accepted as `new` (`rename_key`)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs = rename_key(kwargs, old, new, where=fn.__name__)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def renamed_value(value, old: str, new: str, *, what: str, where: str = ""):
    """`new` where `value` (of the argument or option `what`) is `old` (a DeprecationWarning),
    else `value`."""
    if isinstance(value, str) and value == old:
        warn(f"{what}={old!r}", f"{what}={new!r}", where=where)
        return new
    return value


def moved_names(module: str, moved: Mapping[str, str], removed: Mapping[str, str] | None = None) -> Callable:
    """A module `__getattr__` for `module` whose names moved: `moved` maps a name to its new
    place "package.module:name" (returned with a DeprecationWarning), `removed` a name that is
    gone to what replaces it (an AttributeError saying so)."""

    def __getattr__(name: str):
        if name in moved:
            place, _, new_name = moved[name].partition(":")
            warn(f"{module}.{name}", f"{place}.{new_name}")
            return getattr(importlib.import_module(place), new_name)
        if removed and name in removed:
            raise AttributeError(f"{module}.{name} was removed: {removed[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
