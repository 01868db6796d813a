"""Gated linear attention: the paper's linear attention and its decayed descendants in one op.

Legend: B batch, T time (queries and keys are the same positions: causal self-attention), H
heads, D key/query features, F feature-map features (F = D but for FAVOR+), M value features, X
decay features (1 or F), P devices on the sequence axis.

  s_t = diag(exp(g_t)) s_{t-1} + phi(k_t) v_t^T            (s: [F, M] per head)
  z_t = diag(exp(g_t)) z_{t-1} + phi(k_t)                  (normalize=True only)
  out_t = scale * phi(q_t)^T s_t  [/ (scale * phi(q_t)^T z_t + eps)]

| model                          | log decay g                     | `log_decay` shape |
| ------------------------------ | ------------------------------- | ----------------- |
| this paper (elu, normalised)   | none                            | None              |
| RetNet retention, Lightning    | log(gamma_h), a constant per head | [H]             |
| Mamba-2 (SSD), simple GLA      | a scalar per head and step      | [B, T, H]         |
| GLA                            | one per key feature and step    | [B, T, H, F]      |

`segment_ids` [B, T] packs several sequences into one row: 0 is padding (it adds nothing,
changes no state, and a padding query sees no key, so its output is 0), and the state is
dropped where the id changes, so every segment is computed as if it were alone. The first step
of a call continues `initial_state` (a prefill after a packed prompt carries on its last
segment). Ids of one segment must be contiguous
(`pack_sequences` makes them so).

The forms are in `gated_forms.py`; `causal_linear_attention` is this op with the elu feature
map, a normaliser, scale 1 and no decay.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linear_transformers.ops import input_checks
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.feature_maps import make_feature_map
from linear_transformers.ops.gated_forms import (
    DEFAULT_CHUNK_SIZE,
    FORMS,
    IMPLS,
    apply_totals,
    block_totals,
    chunked_from_raw,
)
from linear_transformers.ops.linear_state import LinearState, init_linear_state, normalise


def check_log_decay(log_decay, shape_BTHF, *, name: str):
    """`log_decay` as a float array of shape [B, T, H, X] (X = 1 or F), or None.

    Accepted: None, [H] (a constant per head), [B, T, H] (per head and step) and [B, T, H, F]
    (per key feature and step); values must be <= 0 (checked when concrete).
    """
    if log_decay is None:
        return None
    B, T, H, F = shape_BTHF
    log_decay = jnp.asarray(log_decay)
    input_checks.check_floating((("log_decay", log_decay),), name=name)
    shapes = {1: (H,), 3: (B, T, H), 4: (B, T, H, F)}
    if shapes.get(log_decay.ndim) != tuple(log_decay.shape):
        raise ValueError(
            f"{name}: log_decay must be [H]={[H]} (a constant per head), [B, T, H]={[B, T, H]} "
            f"(per head and step) or [B, T, H, F]={[B, T, H, F]} (per key feature and step; F is "
            f"the feature map's width), got shape {tuple(log_decay.shape)}."
        )
    if input_checks.is_concrete(log_decay) and log_decay.size:
        largest = float(np.max(np.asarray(log_decay, np.float64)))
        if largest > 0:
            raise ValueError(
                f"{name}: log_decay must be <= 0 (a decay exp(g) in (0, 1]), got a largest value of "
                f"{largest}; e.g. jax.nn.log_sigmoid of a gate logit."
            )
    if log_decay.ndim == 1:
        log_decay = jnp.broadcast_to(log_decay[:, None], (B, T, H, 1))
    elif log_decay.ndim == 3:
        log_decay = log_decay[..., None]
    return log_decay


def check_linear_state(state, expected_BHFM, *, normalize: bool, name: str) -> LinearState:
    """Raise a ValueError unless `state` is a LinearState of shapes s [B, H, F, M] and z [B, H, F]
    (z None when the op does not normalise)."""
    if not isinstance(state, LinearState):
        raise ValueError(
            f"{name}: initial_state must be an ops.LinearState (init_linear_state, "
            f"or the state a call with return_state=True returned), got "
            f"{type(state).__name__}."
        )
    expected_z = tuple(expected_BHFM[:3]) if normalize else None
    z_shape = None if state.z_BHF is None else tuple(state.z_BHF.shape)
    if tuple(state.s_BHFM.shape) != tuple(expected_BHFM) or z_shape != expected_z:
        raise ValueError(
            f"{name}: initial_state shapes s {tuple(state.s_BHFM.shape)}, z {z_shape} do not fit "
            f"the inputs, which need s {tuple(expected_BHFM)} and z {expected_z} "
            f"(init_linear_state(batch, heads, F, M, normalizer={normalize}))."
        )
    for part in state:
        if part is not None and not jnp.issubdtype(part.dtype, jnp.floating):
            raise ValueError(f"{name}: initial_state must be floating point, got {part.dtype}.")
    return state


def _valid_and_resets(T, key_lengths, segment_ids, *, offset, previous_ids):
    """bool [B, T] each: the keys that count (index < key_lengths[b], segment id not 0), and the
    steps where a segment begins (the state is dropped before them); None where all count / none
    begins."""
    valid_BT = reset_BT = None
    if key_lengths is not None:
        valid_BT = offset + jnp.arange(T)[None, :] < key_lengths[:, None]
    if segment_ids is not None:
        previous_BT = jnp.concatenate([previous_ids[:, None], segment_ids[:, :-1]], axis=1)
        present_BT = segment_ids != 0
        valid_BT = present_BT if valid_BT is None else valid_BT & present_BT
        reset_BT = valid_BT & (segment_ids != previous_BT)
    return valid_BT, reset_BT


def _prepare_block(q, k, v, g, valid_BT, *, fm, scale, acc):
    """phi(q) * scale, and phi(k), v, g zeroed where a key does not count, for any stretch of
    steps. `where`, not a product: padded values may hold inf or NaN."""
    phi_q, phi_k = fm.query(q), fm.key(k)
    if scale != 1.0:
        phi_q = phi_q * jnp.asarray(scale, phi_q.dtype)
    g = None if g is None else g.astype(acc)
    if valid_BT is not None:
        valid_BT11 = valid_BT[:, :, None, None]
        phi_k = jnp.where(valid_BT11, phi_k, 0)
        v = jnp.where(valid_BT11, v, 0)
        g = None if g is None else jnp.where(valid_BT11, g, 0)
    return phi_q, phi_k, v, g


def _prepare(q, k, v, g, key_lengths, segment_ids, *, fm, scale, acc, offset, previous_ids):
    """What every form takes: the prepared block (`_prepare_block`) and its resets."""
    valid_BT, reset_BT = _valid_and_resets(
        k.shape[1], key_lengths, segment_ids, offset=offset, previous_ids=previous_ids
    )
    return (*_prepare_block(q, k, v, g, valid_BT, fm=fm, scale=scale, acc=acc), reset_BT)


def _one_device(q, k, v, g, key_lengths, segment_ids, initial_state, *, form, prep, **kw):
    # A call's first step continues the initial state: no segment begins there.
    previous_ids = None if segment_ids is None else segment_ids[:, 0]
    if form is FORMS["chunked"]:
        # Prepared a segment at a time inside the form: no prepared copy of the sequence.
        valid_BT, reset_BT = _valid_and_resets(
            q.shape[1], key_lengths, segment_ids, offset=0, previous_ids=previous_ids
        )
        prepare = functools.partial(_prepare_block, **prep)
        out_BTHM, state = chunked_from_raw(prepare, q, k, v, g, valid_BT, reset_BT, *initial_state, **kw)
        return out_BTHM, LinearState(*state)
    inputs = _prepare(q, k, v, g, key_lengths, segment_ids, offset=0, previous_ids=previous_ids, **prep)
    out_BTHM, state = form(*inputs, *initial_state, **kw)
    return out_BTHM, LinearState(*state)


def _sequence_parallel(q, k, v, g, key_lengths, segment_ids, initial_state, *, axis, form, prep, **kw):
    """The local form: this device's block, after the blocks of the devices before it."""
    T = q.shape[1]
    index = jax.lax.axis_index(axis)
    previous_ids = None
    if segment_ids is not None:
        # A segment begins at this block's first step when its id differs from the last one
        # of the block before.
        last_ids_PB = jax.lax.all_gather(segment_ids[:, -1], axis)
        previous_ids = jnp.where(index > 0, last_ids_PB[jnp.maximum(index - 1, 0)], segment_ids[:, 0])
    phi_q, phi_k, v, g, reset = _prepare(
        q,
        k,
        v,
        g,
        key_lengths,
        segment_ids,
        offset=sp.device_offset(axis, T),
        previous_ids=previous_ids,
        **prep,
    )
    totals = block_totals(phi_k, v, g, reset, kw["acc"], normalize=initial_state.z_BHF is not None)
    if g is None and reset is None:
        # Sums only (LASP-2): the exclusive prefix of the devices' totals, and psum rather than
        # the sum of the gathered totals for the final state: the same on every device by
        # construction, which shard_map can verify for a replicated output.
        _, _, ds, dz = totals
        before = sp.exclusive_prefix(jax.lax.all_gather((ds, dz), axis), axis)
        start = tuple(None if x0 is None else x0 + b for x0, b in zip(initial_state, before))
        final = tuple(
            None if x0 is None else x0 + jax.lax.psum(t, axis) for x0, t in zip(initial_state, (ds, dz))
        )
    else:
        # With decays or segments the devices' totals compose in order, each decaying (or
        # dropping) what came before it: folded over the P gathered totals.
        gathered = sp.gather_replicated(totals, axis)
        final = start = tuple(initial_state)
        for p in range(sp.axis_size(axis)):
            final = apply_totals(final, jax.tree.map(lambda x, p=p: x[p], gathered))
            start = jax.tree.map(lambda new, old, p=p: jnp.where(p < index, new, old), final, start)
    out_BTHM, _ = form(phi_q, phi_k, v, g, reset, *start, **kw)
    return out_BTHM, LinearState(*final)


def gated_linear_attention(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    log_decay=None,
    scale=None,
    feature_map=None,
    normalize=False,
    impl="chunked",
    chunk_size=None,
    eps=1e-6,
    initial_state=None,
    return_state=False,
    key_lengths=None,
    segment_ids=None,
    sequence_axis=None,
):
    """Causal linear attention with a decay on the state: query t reads the keys s <= t of its
    segment, each weighted by the decays between s and t (and the initial state, decayed).

    Args:
      q_BTHD, k_BTHD: [B, T, H, D]; v_BTHM: [B, T, H, M].
      log_decay: g <= 0, the log of the decay applied to the state before step t adds its key:
        None (no decay), [H] (a constant per head), [B, T, H] (per head and step) or
        [B, T, H, F] (per key feature and step). Gradients flow into it.
      scale: multiplies phi(q); None: D**-0.5 (FLA's convention).
      feature_map: None (the identity, as the gated models use it), or a registered name,
        FeatureMap or callable (see `feature_maps`).
      normalize: divide by scale * phi(q_t) . z_t + eps (the paper's normaliser; needs a
        non-negative feature map).
      impl: one of "quadratic", "associative_scan", "chunked", "scan" (`gated_forms.py`); all
        give the same result.
      chunk_size: chunk length C for impl="chunked" (None: `DEFAULT_CHUNK_SIZE`, 64).
      eps: added to the normaliser.
      initial_state: an `ops.LinearState` (s [B, H, F, M], z [B, H, F] or None without a
        normaliser) the sequence continues from. None: zeros. Gradients flow into it.
      return_state: also return the state after the last step.
      key_lengths: int [B] in [0, T]; keys at index >= key_lengths[b] add nothing and decay
        nothing, so a right-padded prompt returns the state after its real tokens (outputs at
        padded positions are not meaningful).
      segment_ids: int [B, T] of packed sequences, 0 = padding (see the module docstring).
      sequence_axis: a mesh axis the time axis is split over (LASP-2; see
        `causal_linear_attention`): each device's block starts from the state of the blocks
        before it, decayed by the decays in between.

    Returns:
      out [B, T, H, M] in the dtype of v, or (out, LinearState) with return_state=True. States,
      decays and normalisers are accumulated in float32 or wider.
    """
    return attend(
        q_BTHD,
        k_BTHD,
        v_BTHM,
        log_decay=log_decay,
        scale=scale,
        feature_map=feature_map,
        normalize=normalize,
        impl=impl,
        chunk_size=chunk_size,
        eps=eps,
        initial_state=initial_state,
        return_state=return_state,
        key_lengths=key_lengths,
        segment_ids=segment_ids,
        sequence_axis=sequence_axis,
        name="gated_linear_attention",
    )


def attend(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    log_decay,
    scale,
    feature_map,
    normalize,
    impl,
    chunk_size,
    eps,
    initial_state,
    return_state,
    key_lengths,
    segment_ids,
    sequence_axis,
    name: str,
):
    """`gated_linear_attention` with its errors named after `name`, the op the caller called."""
    if impl not in IMPLS:
        raise ValueError(f"{name}: unknown impl {impl!r}; expected one of {IMPLS}.")
    chunk_size = input_checks.check_int(chunk_size, f"{name}: chunk_size", allow_none=True)
    for flag, value in (("return_state", return_state), ("normalize", normalize)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: {flag} must be a bool, got {value!r}.")
    input_checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if T != k_BTHD.shape[1]:
        raise ValueError(
            f"{name}: queries and keys must have the same length, got T={T} and S={k_BTHD.shape[1]}."
        )
    fm = make_feature_map("identity" if feature_map is None else feature_map)
    F, M = fm.num_features(D), v_BTHM.shape[-1]
    g = check_log_decay(log_decay, (B, T, H, F), name=name)
    key_lengths = input_checks.check_key_lengths(key_lengths, B, name=name, length=T)
    segment_ids = input_checks.check_segment_ids(segment_ids, (B, T), name=name)
    acc = input_checks.accumulation_dtype(v_BTHM.dtype)
    if initial_state is None:
        initial_state = init_linear_state(B, H, F, M, acc, normalizer=normalize)
    else:
        check_linear_state(initial_state, (B, H, F, M), normalize=normalize, name=name)
        acc = jnp.promote_types(acc, jnp.result_type(*(x for x in initial_state if x is not None)))
        initial_state = LinearState(*(None if x is None else x.astype(acc) for x in initial_state))
    if T == 0:  # Nothing to attend to: no outputs, and the state passes through unchanged.
        out = jnp.zeros((B, 0, H, M), v_BTHM.dtype)
        return (out, initial_state) if return_state else out
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE
    scale = D**-0.5 if scale is None else scale
    kw = dict(
        form=FORMS[impl], prep=dict(fm=fm, scale=scale, acc=acc), acc=acc, eps=eps, chunk_size=chunk_size
    )
    if sequence_axis is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BTHD, v_BTHM, name=name)
    args = (q_BTHD, k_BTHD, v_BTHM, g, key_lengths, segment_ids, initial_state)
    if sequence_axis is None:
        initial_state = sp.match_batch_sharding(initial_state, q_BTHD)
        out, state = _one_device(*args[:-1], initial_state, **kw)
    else:
        if not sp.is_manual(sequence_axis):
            sp.check_sequence_axis(sequence_axis, T, name=name)
        else:
            sp.axis_size(sequence_axis)
        local = functools.partial(_sequence_parallel, axis=sequence_axis, **kw)
        out, state = sp.call_over_sequence(
            local,
            sequence_axis,
            args,
            (sp.TIME, sp.TIME, sp.TIME, sp.TIME, sp.BATCH, sp.TIME, sp.BATCH),
            (sp.TIME, sp.BATCH),
            batch=B,
        )
    if segment_ids is not None:  # A padding query sees no key: 0, as in every kind.
        out = jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return (out, state) if return_state else out


def gated_linear_attention_prefill(state: LinearState, q_BTHD, k_BTHD, v_BTHM, **kwargs):
    """A block of T steps from `state`, in parallel form: -> (state, out [B, T, H, M]).

    Equal to T calls of `gated_linear_attention_step` (up to rounding) and leaves the state
    they would leave; the state keeps its dtypes, so it stays a valid `lax.scan` carry.
    `kwargs` are those of `gated_linear_attention` but initial_state and return_state.
    """
    out_BTHM, new_state = gated_linear_attention(
        q_BTHD, k_BTHD, v_BTHM, initial_state=state, return_state=True, **kwargs
    )
    return keep_dtypes(new_state, state), out_BTHM


def keep_dtypes(new_state: LinearState, old_state: LinearState) -> LinearState:
    """`new_state` in the dtypes of `old_state` (a prefill's state stays a valid scan carry)."""
    return LinearState(
        *(None if new is None else new.astype(old.dtype) for new, old in zip(new_state, old_state))
    )


def gated_linear_attention_step(
    state: LinearState, q_BHD, k_BHD, v_BHM, *, log_decay=None, scale=None, feature_map=None, eps=1e-6
):
    """One step of gated linear attention as an RNN: (state, q_t, k_t, v_t) -> (state, out_t).

    Inputs are [B, H, D] (values [B, H, M]); `log_decay` is None, [H], [B, H] or [B, H, F]; the
    state from `init_linear_state` (with z: normalised, as `normalize=True`). Usable as the
    body of `lax.scan`.
    """
    name = "gated_linear_attention_step"
    input_checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name=name)
    fm = make_feature_map("identity" if feature_map is None else feature_map)
    B, H, D = q_BHD.shape
    F = fm.num_features(D)
    normalize = state.z_BHF is not None if isinstance(state, LinearState) else False
    check_linear_state(state, (B, H, F, v_BHM.shape[-1]), normalize=normalize, name=name)
    acc = state.s_BHFM.dtype
    s, z = state
    if log_decay is not None:
        g = check_log_decay(
            log_decay if jnp.ndim(log_decay) == 1 else jnp.asarray(log_decay)[:, None],
            (B, 1, H, F),
            name=name,
        )[:, 0]
        a = jnp.exp(g.astype(acc))  # [B, H, X]
        s = a[..., None] * s
        z = None if z is None else a * z
    phi_k = fm.key(k_BHD).astype(acc)
    s = s + jnp.einsum("bhf,bhm->bhfm", phi_k, v_BHM.astype(acc))
    phi_q = fm.query(q_BHD).astype(acc) * (D**-0.5 if scale is None else scale)
    num = jnp.einsum("bhf,bhfm->bhm", phi_q, s)
    if z is None:
        return LinearState(s, None), num.astype(v_BHM.dtype)
    z = z + phi_k
    return LinearState(s, z), normalise(num, jnp.einsum("bhf,bhf->bh", phi_q, z), eps, v_BHM.dtype)
