"""Softmax attention: parallel form, plain reference, and the KV-cache recurrent step.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features.
Logits and the softmax are computed in float32 (or wider) whatever the input dtype.

`implementation=None` picks, per call, the form that fits the platform and the arguments
(`default_implementation`): cuDNN flash attention on an NVIDIA GPU wherever it applies;
otherwise, while the [B, H, T, S] float32 logits fit in DENSE_LOGITS_BYTES, the platform's
dense form (`softmax_blocked` on the CPU, faster there than XLA's: BENCHMARKS.md section 1;
`jax.nn.dot_product_attention`'s XLA form elsewhere); beyond that `softmax_chunked`, which
never holds the [T, S] logits at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import _nonfinite, input_checks, precision, softmax_chunked
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.softmax_blocked import blocked_softmax_attention

IMPLEMENTATIONS = (None, "xla", "cudnn", "blocked", "chunked", "reference")
# The dense forms ("blocked", "xla", "reference") only while their float32 logits [B, H, T, S]
# take at most this many bytes: XLA's dense form found no GPU configuration for 68 GB of them
# (B = H = 8, T = S = 16384), and its backward holds several such arrays.
DENSE_LOGITS_BYTES = 2**30
CUDNN_DTYPES = ("bfloat16", "float16")


def platform() -> str:
    """The platform `implementation=None` chooses for: "cuda" on an NVIDIA GPU (where cuDNN
    is), else `jax.default_backend()` ("cpu", "tpu", "gpu" for other GPUs)."""
    backend = jax.default_backend()
    if backend == "gpu" and "cuda" in jax.devices()[0].client.platform_version.lower():
        return "cuda"
    return backend


def cudnn_max_head_dim() -> int:
    """The largest head dim cuDNN's flash attention takes on this device: 256 from Hopper
    (compute capability 9.0) on, 128 before (JAX's own check)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    return 256 if tuple(int(x) for x in capability.split(".")) >= (9, 0) else 128


def default_implementation(
    platform: str,
    *,
    dtype,
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    head_dim: int,
    value_dim: int,
    masked: bool = False,
    segmented: bool = False,
    array_scale: bool = False,
    cudnn_head_dims: int = 128,
) -> str:
    """The implementation `softmax_attention(implementation=None)` runs, from the platform
    ("cuda", "cpu", "tpu", "gpu": `platform()`) and the call's arguments:

    1. "cudnn" (flash attention) on an NVIDIA GPU where it applies: bfloat16 or float16 inputs,
       M == D, D a multiple of 8 up to `cudnn_head_dims` (`cudnn_max_head_dim()`), no explicit
       mask and no segments (through `jax.nn.dot_product_attention` cuDNN would take either as
       a dense [B, H, T, S] bias), and a scale that is a number (cuDNN's is a static option,
       not an array); key lengths and causal masking it does itself.
    2. A dense form while the float32 logits fit in DENSE_LOGITS_BYTES: "blocked" on the CPU,
       elsewhere "xla" (jax.nn.dot_product_attention) where M == D, else "reference".
    3. "chunked": a chunk of queries at a time, never the [T, S] logits at once.
    """
    dtype = jnp.dtype(dtype)
    if (
        platform == "cuda"
        and dtype.name in CUDNN_DTYPES
        and value_dim == head_dim
        and head_dim % 8 == 0
        and head_dim <= cudnn_head_dims
        and not masked
        and not segmented
        and not array_scale
        and num_queries > 0
        and num_keys > 0
    ):
        return "cudnn"
    if batch * heads * num_queries * num_keys * 4 > DENSE_LOGITS_BYTES:
        return "chunked"
    if platform == "cpu":
        return "blocked"
    return "xla" if value_dim == head_dim else "reference"


def _build_mask_BHTS(batch, heads, t, s, *, causal, key_lengths, mask):
    """Combine causal, key-padding and explicit masks into one boolean [B|1, H|1, T, S] mask."""
    combined = None
    if causal:
        combined = jnp.tril(jnp.ones((t, s), bool))[None, None]
    if key_lengths is not None:
        padding = input_checks.key_padding_mask(key_lengths, s)[:, None, None, :]
        combined = padding if combined is None else combined & padding
    mask = input_checks.check_mask(mask, (batch, heads, t, s), name="softmax_attention")
    if mask is not None:
        combined = mask if combined is None else combined & mask
    return combined


def segment_mask_B1TS(query_ids_BT, key_ids_BS):
    """bool [B, 1, T, S]: a query attends to the keys of its own segment (never to padding,
    id 0)."""
    return ((query_ids_BT[:, :, None] == key_ids_BS[:, None, :]) & (key_ids_BS != 0)[:, None, :])[:, None]


def with_segments(mask, segment_ids, key_segment_ids, shape_BHTS):
    """The explicit mask and the segments' mask as one boolean mask (None when neither)."""
    mask = input_checks.check_mask(mask, shape_BHTS, name="softmax_attention")
    if segment_ids is None:
        return mask
    segments = segment_mask_B1TS(segment_ids, key_segment_ids)
    return segments if mask is None else mask & segments


def check_segments(segment_ids, key_segment_ids, shape_BTS, *, name: str):
    """(query ids [B, T], key ids [B, S]) checked, or (None, None). `key_segment_ids` defaults to
    `segment_ids` (self-attention, T == S); key ids alone are an error."""
    B, T, S = shape_BTS
    if segment_ids is None:
        if key_segment_ids is not None:
            raise ValueError(f"{name}: key_segment_ids given without segment_ids (the queries' ids).")
        return None, None
    segment_ids = input_checks.check_segment_ids(segment_ids, (B, T), name=name)
    if key_segment_ids is None:
        if T != S:
            raise ValueError(
                f"{name}: segment_ids alone are for self-attention (T == S), got T={T} and S={S}; "
                f"pass the keys' ids as key_segment_ids."
            )
        return segment_ids, segment_ids
    return segment_ids, input_checks.check_segment_ids(
        key_segment_ids, (B, S), name=name, what="key_segment_ids"
    )


def softmax_attention_weights(q_BTHD, k_BSHD, *, causal=False, key_lengths=None, mask=None, scale=None):
    """Attention probabilities [B, H, T, S], float32 (or float64 for float64 inputs).

    Masked entries get probability 0, and a row with no valid key (every key masked) is 0
    throughout, so its output is 0: the library's rule for an all-masked query, in every kind.
    """
    B, T, H, D = q_BTHD.shape
    S = k_BSHD.shape[1]
    acc = input_checks.accumulation_dtype(q_BTHD.dtype)
    scale = D**-0.5 if scale is None else scale
    logits_BHTS = precision.einsum_in(acc, "bthd,bshd->bhts", q_BTHD, k_BSHD)
    logits_BHTS = logits_BHTS * jnp.asarray(scale, acc)
    mask_BHTS = _build_mask_BHTS(B, H, T, S, causal=causal, key_lengths=key_lengths, mask=mask)
    if mask_BHTS is None:
        return jax.nn.softmax(logits_BHTS, axis=-1)
    logits_BHTS = jnp.where(mask_BHTS, logits_BHTS, jnp.finfo(acc).min)
    # The softmax of a row with no valid key is uniform (finite, so are its gradients); the
    # where on the result, not the logits, makes it 0 without a NaN in either pass.
    has_key_BHT1 = jnp.any(mask_BHTS, axis=-1, keepdims=True)
    return jnp.where(has_key_BHT1, jax.nn.softmax(logits_BHTS, axis=-1), jnp.zeros((), acc))


def has_key_BTH1(t, s, *, causal, key_lengths, mask_BHTS):
    """bool [B|1, T|1, H|1, 1]: the query sees at least one key through the masks (None: every
    query does). Costs a reduction over the mask when one is given, else nothing of size T*S:
    a causal query always sees key 0, so only key_lengths can leave a row empty."""
    if mask_BHTS is not None:
        seen_BHTS = mask_BHTS
        if causal:
            seen_BHTS = seen_BHTS & jnp.tril(jnp.ones((t, s), bool))
        if key_lengths is not None:
            seen_BHTS = seen_BHTS & input_checks.key_padding_mask(key_lengths, s)[:, None, None, :]
        return jnp.swapaxes(jnp.any(seen_BHTS, axis=-1), 1, 2)[..., None]
    if s == 0:
        return jnp.zeros((1, 1, 1, 1), bool)
    if key_lengths is None:
        return None
    return (key_lengths > 0)[:, None, None, None]


def validate_softmax_inputs(q_BTHD, k_BSHD, v_BSHM, *, causal, key_lengths):
    """Check shapes; return key_lengths as int32 [B] (or None)."""
    input_checks.check_qkv(q_BTHD, k_BSHD, v_BSHM, name="softmax_attention")
    if causal and q_BTHD.shape[1] != k_BSHD.shape[1]:
        raise ValueError(
            f"softmax_attention: causal=True needs as many queries as keys, got "
            f"T={q_BTHD.shape[1]} and S={k_BSHD.shape[1]}."
        )
    return input_checks.check_key_lengths(
        key_lengths, q_BTHD.shape[0], name="softmax_attention", length=k_BSHD.shape[1]
    )


def softmax_attention_reference(
    q_BTHD,
    k_BSHD,
    v_BSHM,
    *,
    causal=False,
    key_lengths=None,
    mask=None,
    scale=None,
    segment_ids=None,
    key_segment_ids=None,
):
    """The plain O(T*S) formula softmax(q k^T * scale) v with explicit weights."""
    key_lengths = validate_softmax_inputs(q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths)
    B, T, H, _ = q_BTHD.shape
    segment_ids, key_segment_ids = check_segments(
        segment_ids, key_segment_ids, (B, T, k_BSHD.shape[1]), name="softmax_attention"
    )
    mask = with_segments(mask, segment_ids, key_segment_ids, (B, H, T, k_BSHD.shape[1]))
    w_BHTS = softmax_attention_weights(
        q_BTHD, k_BSHD, causal=causal, key_lengths=key_lengths, mask=mask, scale=scale
    )
    out_BTHM = jnp.einsum("bhts,bshm->bthm", w_BHTS, v_BSHM.astype(w_BHTS.dtype))
    return out_BTHM.astype(v_BSHM.dtype)


def softmax_attention(
    q_BTHD,
    k_BSHD,
    v_BSHM,
    *,
    causal=False,
    key_lengths=None,
    mask=None,
    scale=None,
    implementation=None,
    segment_ids=None,
    key_segment_ids=None,
    sequence_axis=None,
):
    """Softmax attention softmax(q k^T * scale) v.

    Args:
      q_BTHD: queries [B, T, H, D]; k_BSHD keys [B, S, H, D]; v_BSHM values [B, S, H, M].
      causal: query t attends to keys s <= t (needs T == S).
      key_lengths: int [B] in [0, S]; keys at index >= key_lengths[b] are ignored (out of
        range: a ValueError eagerly, clamped under jit).
      mask: boolean [T, S] or [B, H, T, S] (size-1 dimensions broadcast), True = attend; a
        float (additive) mask or a 3-D one is refused (`ops.input_checks.check_mask`).
      scale: multiplies the logits (softmax temperature): a number or a scalar array;
        default 1/sqrt(D).
      implementation: None (the best for the platform and these arguments:
        `default_implementation`), "xla" or "cudnn" (jax.nn.dot_product_attention with that
        implementation; "cudnn" is flash attention on NVIDIA GPUs, for bfloat16 and float16),
        "blocked" (`softmax_blocked`: query blocks in a [B, H, T, D] layout, the CPU's fast
        form), "chunked" (`softmax_chunked`: a lax.scan over chunks of queries, recomputed in
        the backward; memory O(T * chunk) at any length) or "reference" (explicit weights).
      segment_ids: int [B, T] of packed sequences (0 = padding): a query attends only to keys
        of its own segment, so each segment is computed alone. `key_segment_ids` [B, S] are the
        keys' ids where they differ (cross-attention over a packed memory; default the same).
      sequence_axis: mesh axis the time axes of queries and keys are split over. Each device
        all-gathers the keys and values (the whole sequence's, O(S) per device: the baseline to
        compare with linear attention's states) and attends its own queries, offset to their
        global positions for the causal mask. Inside `jax.shard_map` over the axis, or under
        `jax.set_mesh` where the op wraps itself; key_lengths and segment ids are global; `mask`
        is refused. Under a mesh with explicit axis types, time axes sharded on a mesh axis
        select it.

    Returns:
      [B, T, H, M] in the dtype of v. A query that sees no key (every key masked by the mask,
      key_lengths 0 or its segment absent from the keys; segment id 0, padding, is never a
      key) gets 0, with finite gradients.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"softmax_attention: unknown implementation {implementation!r}; "
            f"expected one of {IMPLEMENTATIONS}."
        )
    key_lengths = validate_softmax_inputs(q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths)
    scale = input_checks.check_scale(scale, name="softmax_attention")
    # A scale that is a number keys one compiled program per shapes and options (an eager call
    # would otherwise trace and lower the forms' scans and conds again at every call); cuDNN
    # takes no other.
    numeric_scale = scale is None or input_checks.is_number(scale)
    B, T, H, _ = q_BTHD.shape
    segment_ids, key_segment_ids = check_segments(
        segment_ids, key_segment_ids, (B, T, k_BSHD.shape[1]), name="softmax_attention"
    )
    if sequence_axis is None and mask is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BSHD, v_BSHM, name="softmax_attention")
    if sequence_axis is not None:
        return _sequence_parallel_softmax(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            causal=causal,
            key_lengths=key_lengths,
            mask=mask,
            scale=scale,
            implementation=implementation,
            segment_ids=segment_ids,
            key_segment_ids=key_segment_ids,
            axis=sequence_axis,
        )
    S = k_BSHD.shape[1]
    on = platform()
    choose = functools.partial(
        default_implementation,
        dtype=jnp.result_type(q_BTHD, k_BSHD, v_BSHM),
        batch=B,
        heads=H,
        num_queries=T,
        num_keys=S,
        head_dim=q_BTHD.shape[-1],
        value_dim=v_BSHM.shape[-1],
        masked=mask is not None,
        segmented=segment_ids is not None,
        array_scale=not numeric_scale,
        cudnn_head_dims=cudnn_max_head_dim() if on == "cuda" else 128,
    )
    chosen = implementation is None
    if chosen:
        implementation = choose(on)
    elif implementation == "cudnn" and not numeric_scale:
        raise ValueError(
            "softmax_attention: implementation='cudnn' takes scale as a number (a static option "
            f"of cuDNN's kernel), got an array {scale!r}; pass a float, or implementation=None."
        )
    if implementation == "chunked":
        mask = input_checks.check_mask(mask, (B, H, T, S), name="softmax_attention")
        masks = dict(
            causal=causal,
            key_lengths=key_lengths,
            mask=mask,
            segment_ids=segment_ids,
            key_segment_ids=key_segment_ids,
        )
        chunked = _chunked_softmax_compiled if numeric_scale else _chunked_softmax
        return chunked(q_BTHD, k_BSHD, v_BSHM, scale=scale, **masks)
    mask = with_segments(mask, segment_ids, key_segment_ids, (B, H, T, S))
    dense = _dense_marked_compiled if numeric_scale else _dense_marked
    try:
        return dense(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            causal=causal,
            key_lengths=key_lengths,
            mask=mask,
            scale=scale,
            implementation=implementation,
        )
    except NotImplementedError:
        # cuDNN refused a case the rules above let through (its version, this GPU): the
        # default then falls back to what a GPU without cuDNN runs. An explicit choice raises.
        if not (chosen and implementation == "cudnn"):
            raise
        return softmax_attention(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            causal=causal,
            key_lengths=key_lengths,
            scale=scale,
            implementation=choose("gpu"),
        )


def _dense_marked(q_BTHD, k_BSHD, v_BSHM, *, causal, key_lengths, mask, scale, implementation):
    """A dense form on the finite part of v, NaN where a query sees a non-finite value."""
    T, S = q_BTHD.shape[1], k_BSHD.shape[1]
    B, H = q_BTHD.shape[0], q_BTHD.shape[2]
    # The weights of unseen keys are 0, and 0 * inf is NaN: attend over the finite part of v
    # and mark NaN where a query sees a non-finite value (ops/_nonfinite.py).
    full_mask = (
        None if mask is None else _build_mask_BHTS(B, H, T, S, causal=False, key_lengths=None, mask=mask)
    )
    out_BTHM = _dense_softmax(
        q_BTHD,
        k_BSHD,
        _nonfinite.finite_part(v_BSHM),
        causal=causal,
        key_lengths=key_lengths,
        mask=mask,
        full_mask=full_mask,
        scale=scale,
        implementation=implementation,
    )

    def mark(out_BTHM):
        seen_BTHM = _nonfinite.seen_nonfinite_BTHM(
            v_BSHM, num_queries=T, causal=causal, key_lengths=key_lengths, mask_BHTS=full_mask
        )
        return _nonfinite.mark_seen(out_BTHM, seen_BTHM)

    return _nonfinite.mark_unless_all_finite(v_BSHM, out_BTHM, mark)


def _chunked_softmax(q_BTHD, k_BSHD, v_BSHM, *, scale, **masks):
    """`softmax_chunked` on the finite part of v, NaN where a query sees a non-finite value
    (found a chunk at a time too, and only when there is one: ops/_nonfinite.py)."""
    out_BTHM = softmax_chunked.chunked_softmax_attention(
        q_BTHD, k_BSHD, _nonfinite.finite_part(v_BSHM), scale=scale, **masks
    )

    def mark(out_BTHM):
        seen_BTHM = softmax_chunked.seen_nonfinite_BTHM(v_BSHM, num_queries=q_BTHD.shape[1], **masks)
        return _nonfinite.mark_seen(out_BTHM, seen_BTHM)

    return _nonfinite.mark_unless_all_finite(v_BSHM, out_BTHM, mark)


_dense_marked_compiled = jax.jit(_dense_marked, static_argnames=("causal", "scale", "implementation"))
_chunked_softmax_compiled = jax.jit(_chunked_softmax, static_argnames=("causal", "scale"))


def _dense_softmax(q_BTHD, k_BSHD, v_BSHM, *, causal, key_lengths, mask, full_mask, scale, implementation):
    same_dims = q_BTHD.shape[-1] == v_BSHM.shape[-1]
    if implementation in ("xla", "cudnn") and not same_dims:
        raise ValueError(
            f"softmax_attention: implementation={implementation!r} (jax.nn.dot_product_attention) "
            f"needs value features M equal to key features D, got D={q_BTHD.shape[-1]}, "
            f"M={v_BSHM.shape[-1]}; use implementation=None or 'reference'."
        )
    if implementation == "blocked":
        return blocked_softmax_attention(
            q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths, mask=full_mask, scale=scale
        )
    if implementation == "reference":
        return softmax_attention_reference(
            q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths, mask=mask, scale=scale
        )
    dtype = jnp.result_type(q_BTHD, k_BSHD, v_BSHM)
    out_BTHM = jax.nn.dot_product_attention(
        q_BTHD.astype(dtype),
        k_BSHD.astype(dtype),
        v_BSHM.astype(dtype),
        mask=full_mask,
        scale=scale,
        is_causal=causal,
        key_value_seq_lengths=key_lengths,
        implementation=implementation,
    )
    # jax.nn.dot_product_attention averages the values of a row with no valid key: make it 0,
    # as the reference does (one where on the output).
    has_key = has_key_BTH1(
        q_BTHD.shape[1], k_BSHD.shape[1], causal=causal, key_lengths=key_lengths, mask_BHTS=full_mask
    )
    return out_BTHM if has_key is None else jnp.where(has_key, out_BTHM, jnp.zeros((), out_BTHM.dtype))


def _sequence_parallel_softmax(
    q_BTHD,
    k_BSHD,
    v_BSHM,
    *,
    causal,
    key_lengths,
    mask,
    scale,
    implementation,
    segment_ids,
    key_segment_ids,
    axis,
):
    name = "softmax_attention"
    if mask is not None:
        raise ValueError(
            f"{name}: an explicit mask cannot be combined with sequence_axis (its "
            "[T, S] layout is the global one); use causal, key_lengths and segment_ids."
        )
    if not sp.is_manual(axis):
        sp.check_sequence_axis(axis, q_BTHD.shape[1], name=name)
        sp.check_sequence_axis(axis, k_BSHD.shape[1], name=name)

    def local(q_BTHD, k_BSHD, v_BSHM, key_lengths, segment_ids, key_segment_ids):
        T = q_BTHD.shape[1]
        k_all = jax.lax.all_gather(k_BSHD, axis, axis=1, tiled=True)
        v_all = jax.lax.all_gather(v_BSHM, axis, axis=1, tiled=True)
        local_mask = None
        if causal:
            position_T = sp.device_offset(axis, T) + jnp.arange(T)
            local_mask = (jnp.arange(k_all.shape[1])[None, :] <= position_T[:, None])[None, None]
        if segment_ids is not None:
            key_ids_all = jax.lax.all_gather(key_segment_ids, axis, axis=1, tiled=True)
            segments = segment_mask_B1TS(segment_ids, key_ids_all)
            local_mask = segments if local_mask is None else local_mask & segments
        return softmax_attention(
            q_BTHD,
            k_all,
            v_all,
            key_lengths=key_lengths,
            mask=local_mask,
            scale=scale,
            implementation=implementation,
        )

    return sp.call_over_sequence(
        local,
        axis,
        (q_BTHD, k_BSHD, v_BSHM, key_lengths, segment_ids, key_segment_ids),
        (sp.TIME, sp.TIME, sp.TIME, sp.BATCH, sp.TIME, sp.TIME),
        sp.TIME,
        batch=q_BTHD.shape[0],
    )
