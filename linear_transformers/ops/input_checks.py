"""Input validation shared by the attention ops, the layers and the speech losses: shapes,
dtypes, lengths and masks checked with messages that name the argument and what is allowed.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features.
Checks run on static shapes only, so they cost nothing under `jit`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def check_floating(named_arrays, *, name: str) -> None:
    """Raise a ValueError unless every (name, array) has a floating dtype: integer or boolean
    queries, keys and values would otherwise be computed on and cast back, truncating the
    output."""
    for arr_name, arr in named_arrays:
        dtype = jnp.result_type(arr)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{name}: {arr_name} must be a floating-point array (float32, "
                f"bfloat16, float16, float64), got {dtype}; convert it with "
                f"`.astype(jnp.float32)`."
            )


def check_qkv(q_BTHD, k_BSHD, v_BSHM, *, name: str) -> None:
    """Raise a ValueError naming the bad shape or dtype unless q, k, v form a valid attention
    call."""
    for arr_name, arr in (("q", q_BTHD), ("k", k_BSHD), ("v", v_BSHM)):
        if arr.ndim != 4:
            raise ValueError(
                f"{name}: {arr_name} must have 4 dimensions [batch, time, heads, features], "
                f"got shape {tuple(arr.shape)}."
            )
    check_floating((("q", q_BTHD), ("k", k_BSHD), ("v", v_BSHM)), name=name)
    B, _, H, D = q_BTHD.shape
    if k_BSHD.shape[0] != B or k_BSHD.shape[2] != H or k_BSHD.shape[3] != D:
        raise ValueError(
            f"{name}: k shape {tuple(k_BSHD.shape)} does not match q shape {tuple(q_BTHD.shape)}; "
            "k must be [B, S, H, D] with the batch, heads and features of q."
        )
    if v_BSHM.shape[:3] != k_BSHD.shape[:3]:
        raise ValueError(
            f"{name}: v shape {tuple(v_BSHM.shape)} does not match k shape {tuple(k_BSHD.shape)}; "
            "v must be [B, S, H, M] with the batch, length and heads of k."
        )


def check_causal_qkv(q_BTHD, k_BTHD, v_BTHM, *, name: str) -> tuple[int, int, int, int]:
    """`check_qkv` for causal self-attention (keys as long as queries): -> (B, T, H, D)."""
    check_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if T != k_BTHD.shape[1]:
        raise ValueError(
            f"{name}: queries and keys must have the same length, got T={T} and S={k_BTHD.shape[1]}."
        )
    return B, T, H, D


def check_bools(*, name: str, **flags) -> None:
    """A ValueError naming the first of `flags` (keyword: value) that is not a bool."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}: {flag} must be a bool, got {value!r}.")


def check_step_qkv(q_BHD, k_BHD, v_BHM, *, name: str) -> None:
    """Like `check_qkv` for one time step: q, k are [B, H, D] and v is [B, H, M]."""
    for arr_name, arr in (("q_t", q_BHD), ("k_t", k_BHD), ("v_t", v_BHM)):
        if arr.ndim != 3:
            raise ValueError(
                f"{name}: {arr_name} must have 3 dimensions [batch, heads, features], "
                f"got shape {tuple(arr.shape)}."
            )
    check_floating((("q_t", q_BHD), ("k_t", k_BHD), ("v_t", v_BHM)), name=name)
    if q_BHD.shape != k_BHD.shape:
        raise ValueError(
            f"{name}: q_t shape {tuple(q_BHD.shape)} and k_t shape {tuple(k_BHD.shape)} must be equal."
        )
    if v_BHM.shape[:2] != q_BHD.shape[:2]:
        raise ValueError(
            f"{name}: v_t shape {tuple(v_BHM.shape)} must share batch and heads "
            f"with q_t shape {tuple(q_BHD.shape)}."
        )


def check_int(value, label: str, *, minimum: int | None = 1, allow_none: bool = False, note: str = ""):
    """`value` as a Python int (>= `minimum` unless that is None; None where `allow_none`), else
    a ValueError naming `label` ("linear attention: chunk_size"). Integral numpy scalars
    (np.int64(64)) are ints; a bool (True is not a size) and a float (64.5, and 64.0 too: no
    silent cast) are refused. `note` is appended to the message."""
    if value is None and allow_none:
        return None
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not is_int or (minimum is not None and value < minimum):
        what = (
            ("None or " if allow_none else "") + "an integer" + ("" if minimum is None else f" >= {minimum}")
        )
        got = repr(value) if is_int or value is None else f"{value!r} ({type(value).__name__})"
        raise ValueError(f"{label} must be {what}, got {got}{note}.")
    return int(value)


def check_key_lengths(key_lengths, batch: int, *, name: str, length: int | None = None):
    """Return key_lengths as an int32 [B] array, or raise if its shape is not [B].

    With `length` (the key length S), concrete values outside [0, S] raise a ValueError naming
    them. Under `jit` the values cannot be read: there they act as clamped to [0, S] (a length
    below 0 masks every key, as 0 does; above S masks none, as S does).
    """
    if key_lengths is None:
        return None
    key_lengths = jnp.asarray(key_lengths)
    if key_lengths.shape != (batch,) or not jnp.issubdtype(key_lengths.dtype, jnp.integer):
        raise ValueError(
            f"{name}: key_lengths must be an integer array of shape ({batch},) giving the number of "
            f"valid keys per batch element, got {key_lengths.dtype} array of shape "
            f"{tuple(key_lengths.shape)}."
        )
    if length is not None and is_concrete(key_lengths) and batch:
        values = np.asarray(key_lengths)
        bad = values[(values < 0) | (values > length)]
        if bad.size:
            raise ValueError(
                f"{name}: key_lengths must be in [0, {length}] (the key length), "
                f"got {bad.tolist()} in {values.tolist()}."
            )
    return key_lengths.astype(jnp.int32)


def check_lengths(lengths, batch: int, maximum: int, *, name: str, what: str, where: str):
    """`lengths` as int32 [B]; concrete values outside [0, maximum] raise (under jit they cannot be
    read, and act as clamped by the masks built from them)."""
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{where}: {name} must be an integer array of shape ({batch},) (the number of valid "
            f"{what} per row), got {lengths.dtype} array of shape {tuple(lengths.shape)}."
        )
    if is_concrete(lengths) and batch:
        values = np.asarray(lengths)
        bad = values[(values < 0) | (values > maximum)]
        if bad.size:
            raise ValueError(
                f"{where}: {name} must be in [0, {maximum}] (the padded length), got "
                f"{bad.tolist()} in {values.tolist()}."
            )
    return lengths.astype(jnp.int32)


def check_segment_ids(segment_ids, shape_BT, *, name: str, what: str = "segment_ids"):
    """Return segment ids as an int32 [B, T] array (or None), else a ValueError naming them.

    Packed sequences: 0 is padding, and each other id is one contiguous run of a row (an id
    that comes back after another id would be one segment to softmax attention and two to
    the causal linear forms, so it is refused when the values are concrete).
    """
    if segment_ids is None:
        return None
    segment_ids = jnp.asarray(segment_ids)
    if tuple(segment_ids.shape) != tuple(shape_BT) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"{name}: {what} must be an integer array of shape {tuple(shape_BT)} (batch, time; 0 = "
            f"padding), got {segment_ids.dtype} array of shape {tuple(segment_ids.shape)}."
        )
    if is_concrete(segment_ids) and segment_ids.size:
        ids = np.asarray(segment_ids)
        if ids.min() < 0:
            raise ValueError(f"{name}: {what} must be >= 0 (0 = padding), got {int(ids.min())}.")
        starts = np.ones(ids.shape, bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        rows, cols = np.nonzero(starts & (ids != 0))
        pairs = np.stack([rows, ids[rows, cols]], axis=1)
        unique, counts = np.unique(pairs, axis=0, return_counts=True)
        if (counts > 1).any():
            row, bad = unique[np.argmax(counts > 1)]
            raise ValueError(
                f"{name}: segment id {int(bad)} comes back after another id in row {int(row)} of "
                f"{what}; each segment must be one contiguous run (pack_sequences makes them so)."
            )
    return segment_ids.astype(jnp.int32)


def check_mask(mask, shape_BHTS, *, name: str):
    """A boolean attention mask (True = attend) as [B|1, H|1, T|1, S|1], or a ValueError.

    Accepted: [T, S] (the same for every example and head) or 4-D [B, H, T, S] with any of its
    dimensions 1 to broadcast. A float mask is refused rather than cast: an additive mask
    (0 to attend, -inf or -1e9 to block) would turn into its opposite. Rank 3 is refused because
    it is ambiguous ([B, T, S] or [H, T, S]).
    """
    if mask is None:
        return None
    dtype = jnp.result_type(mask)
    if dtype != jnp.bool_:
        raise ValueError(
            f"{name}: mask must be boolean (True = attend), got {dtype}; for an "
            f"additive mask (0 = attend, a large negative number = blocked) pass "
            f"`mask == 0`."
        )
    mask = jnp.asarray(mask)
    given = tuple(mask.shape)
    if mask.ndim == 2:
        mask = mask[None, None]
    elif mask.ndim != 4:
        raise ValueError(
            f"{name}: mask must be [T, S] or [B, H, T, S] (dimensions of size 1 "
            f"broadcast), got shape {tuple(mask.shape)}; for a per-example "
            f"[B, T, S] mask pass mask[:, None]."
        )
    try:
        jnp.broadcast_shapes(mask.shape, tuple(shape_BHTS))
    except ValueError as e:
        raise ValueError(
            f"{name}: mask of shape {given} does not broadcast to [B, H, T, S] = {tuple(shape_BHTS)}."
        ) from e
    return mask


def key_padding_mask(key_lengths_B, length: int):
    """[B, S] boolean mask, True where key index < key_lengths[b]."""
    return jnp.arange(length)[None, :] < key_lengths_B[:, None]


def accumulation_dtype(dtype) -> jnp.dtype:
    """float32 for half-precision inputs, the input precision when it is higher (float64 tests)
    and JAX computes in it: NumPy's float64 without `jax_enable_x64` is float32 in JAX, and so
    is its accumulation (a float64 buffer a kernel wrote float32 values to would be refused)."""
    return jax.dtypes.canonicalize_dtype(jnp.promote_types(dtype, jnp.float32))


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def is_number(x) -> bool:
    """A Python or NumPy real number: hashable and equal by value, unlike an array."""
    return isinstance(x, numbers.Real)


def _scalar_float(value, what: str, *, name: str):
    """`value` as a scalar array, or a TypeError / ValueError naming it as `what`."""
    if isinstance(value, bool) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name}: {what}, got {value!r}.")
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(
            f"{name}: {what}, got an array of shape {tuple(value.shape)} and dtype {value.dtype}."
        )
    return value


def check_scale(scale, *, name: str):
    """`scale` as given when None or a number; else as a scalar float array (it may be traced, a
    learned scale: gradients flow into it). A scale of any other shape or kind is refused: it
    would broadcast against the features, not scale the products."""
    if scale is None or (is_number(scale) and not isinstance(scale, bool)):
        return scale
    return _scalar_float(scale, "scale must be None, a real number or a scalar float array", name=name)


def check_eps(eps, *, name: str):
    """`eps`, added to a normaliser: a finite number >= 0, or a scalar float array (its value
    checked where it is concrete, an eager call)."""
    what = "eps (added to the normaliser) must be a finite number >= 0 or a scalar float array"
    if not (is_number(eps) and not isinstance(eps, bool)):
        eps = _scalar_float(eps, what, name=name)
        if not is_concrete(eps):
            return eps
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name}: {what}, got {eps!r}.")
    return eps
