"""Gated linear attention, one file per part, as flash-linear-attention lays out a family:

op.py                the public op, its prefill and step (`attend` checks the inputs)
inputs.py            checks of the decays and state; `prepare` (feature maps, masks)
block.py             one block: the whole sequence, or a device's part of a sequence axis
forms.py             the forms by name, and their one interface
reference.py         "reference": the dense decay matrix
associative_scan.py  "associative_scan"
chunked.py           "chunked" (the default): chunks, a segment at a time
chunk_scores.py      the chunked form's decayed scores within a chunk
chunk_segments.py    the chunked form's segment loop and its recomputing backward pass
scan.py              "scan": the RNN
pallas.py            "pallas": the GPU kernel (Triton; Pallas's interpreter on a CPU)
pallas_forward.py    its forward: the one-pass kernel, or the parallel forward's two
pallas_backward.py   its backward: the one-pass passes, or the parallel backward's two
pallas_launch.py     how a kernel is launched: its grid, layouts and `Tuning`
pallas_walks.py      the walks over each sequence's chunks in stretches, and their join
pallas_kernels.py    its forward and backward kernels: the loops over the chunks
pallas_chunk.py      one chunk in those kernels: its scores, output, state and cotangents
totals.py            what a stretch of steps does to the state; sums of log decays
nonfinite.py         the guard of the forms that multiply by masked weights
"""

from linear_transformers.ops.gated_linear.chunked import DEFAULT_CHUNK_SIZE
from linear_transformers.ops.gated_linear.forms import FORMS, LINEAR_IMPLEMENTATIONS
from linear_transformers.ops.gated_linear.inputs import check_linear_state, check_log_decay
from linear_transformers.ops.gated_linear.op import (
    attend,
    gated_linear_attention,
    gated_linear_attention_prefill,
    gated_linear_attention_step,
    keep_dtypes,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FORMS",
    "LINEAR_IMPLEMENTATIONS",
    "attend",
    "check_linear_state",
    "check_log_decay",
    "gated_linear_attention",
    "gated_linear_attention_prefill",
    "gated_linear_attention_step",
    "keep_dtypes",
]
