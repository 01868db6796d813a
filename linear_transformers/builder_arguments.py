"""Deprecated: moved to `linear_transformers.interop.builder_arguments` (the authors' builder
arguments belong with the rest of the authors' library). Its names are still read here, each
with a DeprecationWarning naming the new place; importing this module says nothing.
"""

from __future__ import annotations

from linear_transformers import _deprecation

__getattr__ = _deprecation.moved_names(
    __name__,
    {
        name: f"linear_transformers.interop.builder_arguments:{name}"
        for name in ("KNOWN_ARGUMENTS", "builder_fields")
    },
)
