"""`delta_rule_attention`: DeltaNet (Schlag et al. 2021; Yang et al. 2024), Gated DeltaNet (Yang
et al. 2025, the linear layer of Qwen3-Next) and Kimi Delta Attention (a per-feature decay, the
linear layer of Kimi Linear) in one op.

Legend: B batch, T time, H heads, D key/query features, M value features, X decay features (1 or D).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linear_transformers.ops import input_checks
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.delta_rule import chunked, nonfinite, reference, scan
from linear_transformers.ops.gated_linear import chunk_segments
from linear_transformers.ops.gated_linear.block import flags
from linear_transformers.ops.gated_linear.inputs import check_linear_state, check_log_decay, prepare_log_decay
from linear_transformers.ops.linear_state import LinearState, init_linear_state

# Every form carries the non-finite guard (`nonfinite.py`): one semantics whichever runs.
FORMS = {
    name: nonfinite.guarded(m.form)
    for name, m in (("reference", reference), ("scan", scan), ("chunked", chunked))
}
L2_NORM_EPS = 1e-6  # FLA's: x / sqrt(sum x^2 + eps).


def l2_normalize(x_xD, eps: float = L2_NORM_EPS):
    """x / sqrt(sum x^2 + eps) over the last axis, in float32 at least."""
    # On [rows, D]: XLA:CPU fuses the backward pass's multiply-reduce 2-3x slower when the
    # operand keeps a size-1 axis (batch 1), chunked.py's docstring says more.
    x = x_xD.astype(jnp.promote_types(x_xD.dtype, jnp.float32)).reshape(-1, x_xD.shape[-1])
    return (x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)).reshape(x_xD.shape)


def _check_beta(beta, shape_BTH, name: str):
    beta = jnp.asarray(beta)
    input_checks.check_floating((("beta", beta),), name=name)
    if tuple(beta.shape) != tuple(shape_BTH):
        raise ValueError(
            f"{name}: beta must be [B, T, H]={list(shape_BTH)} (the writing strength of each step), "
            f"got shape {tuple(beta.shape)}."
        )
    if input_checks.is_concrete(beta) and beta.size:
        values = np.asarray(beta, np.float64)
        if not (np.all(values >= 0) and np.all(values <= 2)):
            raise ValueError(
                f"{name}: beta must be in [0, 2] (1 replaces a key's value, 2 reflects it; "
                f"jax.nn.sigmoid of a logit, times 2 for negative eigenvalues), got values in "
                f"[{np.nanmin(values)}, {np.nanmax(values)}]."
            )
    return beta


def _prepare(q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, valid_BT, *, acc, qk_l2norm, scale):
    """q, k normalised (if asked) and q scaled, all in `acc`; beta = 0, k = v = 0 and g = 0 where a
    step does not count (`valid_BT` False), so it writes nothing and keeps the state."""
    q, k = (x.astype(acc) for x in (q_BTHD, k_BTHD))
    if qk_l2norm:
        q, k = l2_normalize(q).astype(acc), l2_normalize(k).astype(acc)
    q = q * jnp.asarray(scale, acc)
    v, beta = v_BTHM.astype(acc), beta_BTH.astype(acc)
    g = None if g_BTHX is None else prepare_log_decay(g_BTHX, valid_BT, acc)
    if valid_BT is not None:
        beta = jnp.where(valid_BT[:, :, None], beta, 0)
        k = jnp.where(valid_BT[:, :, None, None], k, 0)
        v = jnp.where(valid_BT[:, :, None, None], v, 0)
    return q, k, v, beta, g


def _attend_block(
    q, k, v, beta, g, key_lengths_B, segment_ids_BT, s0_BHDM, *, axis, form, segment, **options
):
    """-> (out [B, T, H, M], the final state): the whole sequence (axis None), at once or in
    segments of `segment` steps (None: at once; only with axis None), or this device's block of
    a sequence split over `axis`. `options`: `_prepare`'s."""
    valid_BT, reset_BT = flags(q.shape[1], key_lengths_B, segment_ids_BT, axis=axis)
    if segment is not None:
        out, final = _in_segments(form, (q, k, v, beta, g), valid_BT, reset_BT, s0_BHDM, segment, **options)
    else:
        q, k, v, beta, g = _prepare(q, k, v, beta, g, valid_BT, **options)
        if axis is None:
            out, final = form(q, k, v, beta, g, reset_BT, s0_BHDM)
        else:
            start, final = _start_and_final(form, q, k, v, beta, g, reset_BT, s0_BHDM, axis)
            out, _ = form(q, k, v, beta, g, reset_BT, start)
    if valid_BT is not None:  # A query that does not count sees nothing: 0, as in every kind.
        out = jnp.where(valid_BT[:, :, None, None], out, 0)
    return out, final


def _in_segments(form, inputs, valid_BT, reset_BT, s0_BHDM, L: int, *, scale, **options):
    """`form` over segments of L steps in sequence, each prepared on its own, the state carried
    (`gated_linear/chunk_segments.py`): the backward pass keeps the raw inputs and the state
    entering each segment, and recomputes one segment at a time."""
    B, T, H, M = inputs[2].shape
    pad = -T % L
    if pad:  # Padding counts for nothing (valid False): it writes nothing and keeps the state.
        valid_BT = (
            jnp.arange(T + pad)[None] < T if valid_BT is None else chunk_segments.pad_time(valid_BT, pad)
        )
        inputs = tuple(chunk_segments.pad_time(x, pad) for x in inputs)
        reset_BT = chunk_segments.pad_time(reset_BT, pad)

    def segment_fn(consts, s_BHDM, inputs, flags):
        (scale,) = consts  # An argument, not a closure: it may be traced, and is differentiated.
        valid, reset = flags
        out, s_BHDM = form(*_prepare(*inputs, valid, scale=scale, **options), reset, s_BHDM)
        return s_BHDM, out

    scale = (jnp.asarray(scale, options["acc"]),)
    out_spec = ((B, T + pad, H, M), options["acc"])
    flags = (valid_BT, reset_BT)
    out, final = chunk_segments.run_segments(
        segment_fn, scale, inputs, flags, s0_BHDM, (T + pad) // L, L, out_spec
    )
    return out[:, :T], final


def _start_and_final(form, q, k, v, beta, g, reset_BT, s0_BHDM, axis):
    """The state this device's block starts from, and the global final state. The block maps the
    state entering it to P S + Q (or to Q alone where a segment begins in it), column by column
    alike: one run of the form on the columns [I, 0] with values [0, v] leaves [P, Q]. The P
    devices' maps compose in order; a dropped state is dropped with `where`, so a NaN that an
    earlier device's segment holds reaches no later segment."""
    B, _, H, D = k.shape
    identity_BHDD = jnp.broadcast_to(jnp.eye(D, dtype=s0_BHDM.dtype), (B, H, D, D))
    entering = jnp.concatenate([identity_BHDD, jnp.zeros_like(s0_BHDM)], axis=-1)
    _, PQ = form(q, k, jnp.concatenate([jnp.zeros_like(k), v], axis=-1), beta, g, reset_BT, entering)
    dropped_B = jnp.zeros((B,), bool) if reset_BT is None else jnp.any(reset_BT, axis=1)
    maps = sp.gather_replicated((PQ[..., :D], PQ[..., D:], dropped_B), axis)
    index = jax.lax.axis_index(axis)
    start = final = s0_BHDM
    for p in range(sp.axis_size(axis)):
        kept = jnp.where(maps[2][p][:, None, None, None], 0, jnp.einsum("bhde,bhem->bhdm", maps[0][p], final))
        final = kept + maps[1][p]
        start = jnp.where(p < index, final, start)
    return start, final


def _attend(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    beta_BTH,
    g_BTHX,
    key_lengths,
    segment_ids,
    s0_BHDM,
    *,
    implementation,
    chunk_size,
    segment,
    axis,
    **options,
):
    """-> (out, final state) of the whole sequence (axis None) or of this device's block: the form
    bound to its options, the decayed scores' form chosen per call where the decay is per feature.
    `options`: `_prepare`'s."""
    form = FORMS[implementation]
    if implementation == "chunked":
        form = functools.partial(form, chunk_size=chunk_size)

    def block_of(form):
        block = functools.partial(_attend_block, axis=axis, form=form, segment=segment, **options)
        if implementation == "chunked" and segment is None:
            # The prepared inputs and every chunk intermediate recomputed in the backward pass. (In
            # segments, the segments' loop keeps the inputs and one state per segment already.)
            block = chunked.keeping_chunk_states(block)
        return block

    args = (q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, key_lengths, segment_ids, s0_BHDM)
    if implementation == "chunked" and axis is None and g_BTHX is not None and g_BTHX.shape[-1] > 1:
        # Per feature, the form of the decayed scores (`chunk_scores.py`) is chosen once for the
        # whole call: a cond per segment kept XLA from fusing each segment's preparation into
        # its chunks (~12% of forward+backward on CPU at N = 4096). The branches' residuals are
        # alike (the inputs, and the states the segments' loop or `keeping_chunk_states` keeps),
        # and the cond's derivative shares residuals of one type between its branches. (A block
        # of a split sequence chooses per call of the form: `chunk_scores.in_either_form`.)
        fits = chunked.fits_factored(g_BTHX, chunk_size, segment)
        factored, blocked = (block_of(functools.partial(form, factored=f)) for f in (True, False))
        return jax.lax.cond(fits, factored, blocked, *args)
    return block_of(form)(*args)


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size", "segment", "acc", "qk_l2norm"))
def _attend_compiled(*args, scale, **options):
    """`_attend` of the whole sequence as one compiled program per shapes and options (`scale`
    is traced: it may be a number or an array). Called eagerly, the forms' scans and conds
    (closures, new at every call) would be traced, lowered and looked up in the compilation cache
    again at every call; inside a caller's `jit` its layers of one shape share one trace."""
    return _attend(*args, axis=None, scale=scale, **options)


def delta_rule_attention(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    beta_BTH,
    *,
    log_decay=None,
    scale=None,
    qk_l2norm: bool = True,
    implementation: str = "chunked",
    chunk_size: int | None = None,
    initial_state: LinearState | None = None,
    return_state: bool = False,
    key_lengths=None,
    segment_ids=None,
    sequence_axis: str | None = None,
):
    """Causal attention whose state is corrected, not only added to (the delta rule):

      S_t = diag(exp(g_t)) S_{t-1};   S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T;   o_t = S_t^T q_t

    i.e. S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T, a [D, M] state per
    head (no normaliser).

    Args:
      q_BTHD, k_BTHD: [B, T, H, D]; v_BTHM: [B, T, H, M].
      beta_BTH: [B, T, H], in [0, 2]: how much of step t's value replaces what the state
        predicts for its key (checked when concrete).
      log_decay: g <= 0: None (DeltaNet), [H] or [B, T, H] (Gated DeltaNet: per head and step),
        [B, T, H, D] (KDA: per key feature and step). -inf is a reset (a decay of 0; per
        feature, of its row). Non-finite inputs follow `nonfinite.py`: a NaN decay makes NaN
        its head from its step to its segment's end, a non-finite value (or initial-state
        entry) its column; nothing else, in values and gradients.
      scale: multiplies q (after the norm): a number or a scalar array; default D**-0.5.
      qk_l2norm: L2-normalise q and k over D first (FLA's `use_qk_l2norm_in_kernel`; the delta
        rule is stable for ||k|| = 1 and beta in [0, 2]).
      implementation: "chunked" (default; the WY representation per chunk, one scan over
        chunks), "scan" (one step at a time) or "reference" (the recurrence unrolled in Python).
      chunk_size: steps per chunk of "chunked" (default `chunked.default_chunk_size()`: 32 on
        CPU, 64 elsewhere).
      initial_state: an `ops.LinearState` with s [B, H, D, M] and no z; default zeros.
      return_state: also return the final state.
      key_lengths: int [B]: steps past it do not count (their outputs are 0, the state skips
        them).
      segment_ids: int [B, T] of packed sequences (0 = padding): the state is dropped where a
        segment begins, so no state crosses a boundary; the first step continues
        `initial_state`.
      sequence_axis: a mesh axis to split time over (sequence parallelism, LASP-2 style): each
        device summarises its block as the affine map S -> P S + Q its steps apply to the
        state entering it (P [D, D], Q [D, M]), the devices gather the maps and compose those
        before them, then run their block from that state. Equal to one device; every device
        returns the global final state.

    Returns:
      out [B, T, H, M] in v's dtype, or (out, LinearState(s, None)) with `return_state`. The
      state is carried in float32 at least.
    """
    name = "delta_rule_attention"
    if implementation not in FORMS:
        raise ValueError(
            f"{name}: unknown implementation {implementation!r}; expected one of {tuple(FORMS)}."
        )
    chunk_size = input_checks.check_int(chunk_size, f"{name}: chunk_size", allow_none=True)
    input_checks.check_bools(name=name, return_state=return_state, qk_l2norm=qk_l2norm)
    B, T, H, D = input_checks.check_causal_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    scale = input_checks.check_scale(scale, name=name)
    M = v_BTHM.shape[-1]
    beta_BTH = _check_beta(beta_BTH, (B, T, H), name)
    g_BTHX = check_log_decay(log_decay, (B, T, H, D), name=name)
    key_lengths = input_checks.check_key_lengths(key_lengths, B, name=name, length=T)
    segment_ids = input_checks.check_segment_ids(segment_ids, (B, T), name=name)
    acc = input_checks.accumulation_dtype(v_BTHM.dtype)
    if initial_state is None:
        initial_state = init_linear_state(B, H, D, M, acc, normalizer=False)
    else:
        check_linear_state(initial_state, (B, H, D, M), normalize=False, name=name)
        acc = jnp.promote_types(acc, initial_state.s_BHFM.dtype)
    s0_BHDM = initial_state.s_BHFM.astype(acc)
    if T == 0:
        out = jnp.zeros((B, 0, H, M), v_BTHM.dtype)
        return (out, LinearState(s0_BHDM, None)) if return_state else out

    if implementation == "chunked":
        chunk_size = chunked.default_chunk_size() if chunk_size is None else chunk_size
    scale = D**-0.5 if scale is None else scale
    if sequence_axis is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BTHD, v_BTHM, name=name)
    # One device's whole sequence longer than a segment runs in segments
    # (`chunked.segment_length`); a block of a split sequence runs at once.
    segment = None
    if implementation == "chunked" and sequence_axis is None:
        segment = chunked.segment_length()
        segment = segment if segment is not None and T > segment else None
    args = (q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, key_lengths, segment_ids, s0_BHDM)
    options = dict(
        implementation=implementation, chunk_size=chunk_size, segment=segment, acc=acc, qk_l2norm=qk_l2norm
    )
    if sequence_axis is None:
        out, s_BHDM = _attend_compiled(*args, scale=scale, **options)
    else:
        if not sp.is_manual(sequence_axis):
            sp.check_sequence_axis(sequence_axis, T, name=name)
        out, s_BHDM = sp.call_over_sequence(
            functools.partial(_attend, axis=sequence_axis, scale=scale, **options),
            sequence_axis,
            args,
            (sp.TIME, sp.TIME, sp.TIME, sp.TIME, sp.TIME, sp.BATCH, sp.TIME, sp.BATCH),
            (sp.TIME, sp.BATCH),
            batch=B,
        )
    out = out.astype(v_BTHM.dtype)
    return (out, LinearState(s_BHDM, None)) if return_state else out


def delta_rule_attention_step(
    state: LinearState, q_BHD, k_BHD, v_BHM, beta_BH, *, log_decay=None, scale=None, qk_l2norm: bool = True
):
    """One step of `delta_rule_attention`: -> (state, out [B, H, M]). Inputs are [B, H, D] (values
    [B, H, M]), beta [B, H]; `log_decay` is None, [H], [B, H] or [B, H, D]. The state keeps its
    dtype, so it stays a valid `lax.scan` carry."""
    name = "delta_rule_attention_step"
    input_checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name=name)
    scale = input_checks.check_scale(scale, name=name)
    B, H, D = q_BHD.shape
    M = v_BHM.shape[-1]
    check_linear_state(state, (B, H, D, M), normalize=False, name=name)
    beta_BH = _check_beta(jnp.asarray(beta_BH)[:, None], (B, 1, H), name)[:, 0]
    g = check_log_decay(log_decay, (B, 1, H, D), name=name, step=True)
    acc = state.s_BHFM.dtype
    q, k = (x.astype(acc) for x in (q_BHD, k_BHD))
    if qk_l2norm:
        q, k = l2_normalize(q).astype(acc), l2_normalize(k).astype(acc)
    q = q * jnp.asarray(D**-0.5 if scale is None else scale, acc)
    g_BHX = None if g is None else prepare_log_decay(g, None, acc)[:, 0]
    s_BHDM, out_BHM = reference.step(state.s_BHFM, q, k, v_BHM.astype(acc), beta_BH.astype(acc), g_BHX)
    return LinearState(s_BHDM, None), out_BHM.astype(v_BHM.dtype)


def delta_rule_attention_prefill(state: LinearState, q_BTHD, k_BTHD, v_BTHM, beta_BTH, **kwargs):
    """A block of T steps from `state` in parallel form: -> (state, out [B, T, H, M]), equal to T
    calls of `delta_rule_attention_step`. `kwargs` are those of `delta_rule_attention` but
    initial_state and return_state."""
    out_BTHM, new_state = delta_rule_attention(
        q_BTHD, k_BTHD, v_BTHM, beta_BTH, initial_state=state, return_state=True, **kwargs
    )
    return LinearState(new_state.s_BHFM.astype(state.s_BHFM.dtype), None), out_BTHM
