"""Deprecated: the chunked form's segment loop moved to `ops.gated_linear.chunk_segments`. The
names below still resolve, with a DeprecationWarning naming their new place, until the next
release.
"""

from linear_transformers import _deprecation

__getattr__ = _deprecation.moved_names(
    __name__, {"run_segments": "linear_transformers.ops.gated_linear.chunk_segments:run_segments"}
)
