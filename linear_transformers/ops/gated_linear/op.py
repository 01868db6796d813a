"""Gated linear attention: the paper's linear attention and its decayed descendants in one op.

Legend: B batch, T time (queries and keys are the same positions: causal self-attention), H
heads, D key/query features, F feature-map features (F = D but for FAVOR+), M value features, X
decay features (1 or F).

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
segment). Ids of one segment must be contiguous (`pack_sequences` makes them so).

`attend` checks the inputs and runs a form (`forms.py`) over the sequence as one block (one
compiled program per shapes and options, eager calls included), or over the devices of a
sequence axis (`block.py`). `causal_linear_attention` is this op with the elu
feature map, a normaliser, scale 1 and no decay.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers import _deprecation
from linear_transformers.ops import input_checks
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.feature_maps import CallableFeatureMap, make_feature_map
from linear_transformers.ops.gated_linear import block, inputs, pallas_launch
from linear_transformers.ops.gated_linear.chunked import DEFAULT_CHUNK_SIZE
from linear_transformers.ops.gated_linear.forms import FORMS, LINEAR_IMPLEMENTATIONS
from linear_transformers.ops.gated_linear.inputs import check_linear_state, check_log_decay
from linear_transformers.ops.linear_state import LinearState, init_linear_state, normalise


@_deprecation.renamed_keyword("impl", "implementation")
def gated_linear_attention(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    log_decay=None,
    scale=None,
    feature_map=None,
    normalize=False,
    implementation="chunked",
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
        [B, T, H, F] (per key feature and step). Gradients flow into it. g = -inf is a decay of
        0, a reset of the state (of its features), exact and finite in every form. A NaN makes
        NaN every output it decays: the steps >= t of its segment (and the rows of the final
        state it reaches), in every form; a positive value is refused by an eager call and read
        as NaN under `jit` or `vmap`, where the check cannot run.
      scale: multiplies phi(q): a number, or a scalar array (a learned scale: gradients flow
        into it); None: D**-0.5 (FLA's convention).
      feature_map: None (the identity, as the gated models use it), or a registered name,
        FeatureMap or callable (see `feature_maps`).
      normalize: divide by scale * phi(q_t) . z_t + eps (the paper's normaliser; needs a
        non-negative feature map).
      implementation: one of `LINEAR_IMPLEMENTATIONS`, "reference", "associative_scan",
        "chunked", "scan", "pallas" (the GPU kernel, interpreted on a CPU; `pallas.py`)
        (`forms.py`); all give the same result.
      chunk_size: chunk length C for implementation="chunked" (None: `DEFAULT_CHUNK_SIZE`, 64)
        or "pallas" (a power of two >= 16; None: 32).
      eps: added to the normaliser: a number >= 0, or a scalar array.
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
        implementation=implementation,
        chunk_size=chunk_size,
        eps=eps,
        initial_state=initial_state,
        return_state=return_state,
        key_lengths=key_lengths,
        segment_ids=segment_ids,
        sequence_axis=sequence_axis,
        name="gated_linear_attention",
    )


def _check_implementation(implementation, name: str) -> str:
    implementation = _deprecation.renamed_value(
        implementation, "quadratic", "reference", what="implementation", where=name
    )
    if implementation not in LINEAR_IMPLEMENTATIONS:
        raise ValueError(
            f"{name}: unknown implementation {implementation!r}; expected one of {LINEAR_IMPLEMENTATIONS}."
        )
    return implementation


@_deprecation.renamed_keyword("impl", "implementation")
def attend(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    log_decay,
    scale,
    feature_map,
    normalize,
    implementation,
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
    implementation = _check_implementation(implementation, name)
    chunk_size = input_checks.check_int(chunk_size, f"{name}: chunk_size", allow_none=True)
    input_checks.check_bools(name=name, return_state=return_state, normalize=normalize)
    B, T, H, D = input_checks.check_causal_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    scale = input_checks.check_scale(scale, name=name)
    eps = input_checks.check_eps(eps, name=name)
    fm = make_feature_map("identity" if feature_map is None else feature_map)
    F, M = fm.num_features(D), v_BTHM.shape[-1]
    g_BTHX = check_log_decay(log_decay, (B, T, H, F), name=name)
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
    scale = D**-0.5 if scale is None else scale
    options = dict(implementation=implementation, chunk_size=chunk_size, fm=fm, scale=scale, eps=eps, acc=acc)
    if sequence_axis is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BTHD, v_BTHM, name=name)
    if sequence_axis is None:
        initial_state = sp.match_batch_sharding(initial_state, q_BTHD)
        args = (q_BTHD, k_BTHD, v_BTHM, g_BTHX, key_lengths, segment_ids, initial_state)
        if _static_options(fm, scale, eps):
            out, state = _attend_compiled(*args, tuning=pallas_launch.current_tuning(), **options)
        else:
            out, state = _attend_whole(*args, **options)
    else:
        options = _block_options(**options)
        if not sp.is_manual(sequence_axis):
            sp.check_sequence_axis(sequence_axis, T, name=name)
        else:
            sp.axis_size(sequence_axis)
        out, state = sp.call_over_sequence(
            functools.partial(block.attend_block, axis=sequence_axis, **options),
            sequence_axis,
            (q_BTHD, k_BTHD, v_BTHM, g_BTHX, key_lengths, segment_ids, initial_state),
            (sp.TIME, sp.TIME, sp.TIME, sp.TIME, sp.BATCH, sp.TIME, sp.BATCH),
            (sp.TIME, sp.BATCH),
            batch=B,
        )
    if segment_ids is not None:  # A padding query sees no key: 0, as in every kind.
        out = jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return (out, state) if return_state else out


def _block_options(*, implementation, chunk_size, fm, scale, eps, acc) -> dict:
    """`block.attend_block`'s options: the form bound to its chunk size, and the preparation."""
    form = FORMS[implementation]
    if implementation == "chunked":
        form = functools.partial(form, chunk_size=DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size)
    elif implementation == "pallas":
        form = functools.partial(form, chunk_size=chunk_size)
    return dict(form=form, prepare=inputs.Preparation(fm, scale, acc), eps=eps, acc=acc)


def _attend_whole(q_BTHD, k_BTHD, v_BTHM, g_BTHX, key_lengths, segment_ids, initial_state, **options):
    """The whole sequence on one device: -> (out, the final LinearState)."""
    return block.attend_block(
        q_BTHD,
        k_BTHD,
        v_BTHM,
        g_BTHX,
        key_lengths,
        segment_ids,
        initial_state,
        axis=None,
        **_block_options(**options),
    )


def _static_options(fm, scale, eps) -> bool:
    """Whether the options can key a compiled program: a feature map equal by value (a wrapped
    function, not one holding arrays such as FAVOR+'s projection) and numbers, not arrays."""
    return isinstance(fm, CallableFeatureMap) and all(input_checks.is_number(x) for x in (scale, eps))


@functools.partial(
    jax.jit, static_argnames=("implementation", "chunk_size", "fm", "scale", "eps", "acc", "tuning")
)
def _attend_compiled(*arrays, tuning, **options):
    """`_attend_whole` as one compiled program per shapes and options. Called eagerly, the forms'
    scans and conds (closures, new at every call) would each be traced, lowered and looked up in
    the compilation cache again at every call: 0.36 s for a call at B=2, T=64 on a CPU where the
    compiled program takes 1 ms. Inside a caller's `jit` its layers of one shape share one trace.
    `tuning` is only a key: the Pallas form reads it while traced (`pallas_launch.tuning`)."""
    del tuning
    return _attend_whole(*arrays, **options)


@_deprecation.renamed_keyword("impl", "implementation")
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
    scale = input_checks.check_scale(scale, name=name)
    eps = input_checks.check_eps(eps, name=name)
    fm = make_feature_map("identity" if feature_map is None else feature_map)
    B, H, D = q_BHD.shape
    F = fm.num_features(D)
    normalize = state.z_BHF is not None if isinstance(state, LinearState) else False
    check_linear_state(state, (B, H, F, v_BHM.shape[-1]), normalize=normalize, name=name)
    acc = state.s_BHFM.dtype
    s, z = state
    if log_decay is not None:
        g = check_log_decay(log_decay, (B, 1, H, F), name=name, step=True)[:, 0]
        a = jnp.exp(inputs.prepare_log_decay(g, None, acc))  # [B, H, X]
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
