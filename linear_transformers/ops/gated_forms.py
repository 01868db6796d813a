"""Deprecated: the forms of gated linear attention moved to the package `ops.gated_linear`, one
file per form (`forms.py` lists them). The names below still resolve, with a DeprecationWarning
naming their new place, until the next release.
"""

from linear_transformers import _deprecation

_NEW = "linear_transformers.ops.gated_linear"

__getattr__ = _deprecation.moved_names(
    __name__,
    {
        "DEFAULT_CHUNK_SIZE": f"{_NEW}.chunked:DEFAULT_CHUNK_SIZE",
        "segment_length": f"{_NEW}.chunked:segment_length",
        "FACTOR_RANGE": f"{_NEW}.chunk_scores:FACTOR_RANGE",
        "EXACT_BLOCK": f"{_NEW}.chunk_scores:EXACT_BLOCK",
        "block_totals": f"{_NEW}.totals:block_totals",
        "apply_totals": f"{_NEW}.totals:apply_totals",
        "FORMS": f"{_NEW}.forms:FORMS",
        "IMPLS": f"{_NEW}.forms:LINEAR_IMPLEMENTATIONS",
    },
    {
        "chunked_from_raw": (
            f"every form takes raw inputs and a `prepare` function now; the chunked one is "
            f"{_NEW}.forms.FORMS['chunked'] (with its non-finite guard; {_NEW}.chunked.form without)."
        ),
    },
)
