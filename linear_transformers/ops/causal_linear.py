"""Causal linear attention in four forms that compute the same thing, from any starting state.

Legend: B batch, T query time, S key time (the same positions: causal self-attention), H heads,
D key/query features, F feature-map features, M value features, C chunk length, N number of
chunks, G segments of chunks (the chunked form's `lax.scan` on CPU), P devices on the sequence
axis; `x` in a suffix: any leading shape.

  out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps),  S_t = S_0 + sum_{s<=t} phi(k_s) v_s^T,
                                                     z_t = z_0 + sum_{s<=t} phi(k_s)

(S_0, z_0) is the `initial_state` (zero by default): the state the RNN form would hold after
the tokens before this block, so a prompt, or a long sequence cut into segments, is processed in
parallel and carried on from where it ended (`return_state=True` gives (S_T, z_T)).

- "quadratic": the masked [T, T] product; O(T^2) time and memory. The reference.
- "associative_scan": `jax.lax.associative_scan` of the prefix states; O(T log T) work but one
  [F, M] state per position in memory.
- "chunked": within a chunk of C steps the masked [C, C] product, between chunks the prefix sum of
  per-chunk states; O(T*C + (T/C)*F*M) memory, matmul-shaped work. The default. On CPU the
  chunks go in segments of `segment_length()` steps through a `lax.scan` carrying (S, z), which
  keeps each segment in cache. (A hand-written VJP made of the same chunked products was slower
  and larger on CPU than autodiff: BENCHMARKS.md.)
- "scan": the RNN, `lax.scan` of the (S, z) update; O(F*M) state, T sequential steps.

With `sequence_axis`, the time axis is split over the devices of a mesh axis (LASP-2, Sun et al.
2025): each device reduces its block to its (S, z) totals, one all-gather shares these F x M
states, and each device finishes its own block from the exclusive prefix of the devices before
it. The traffic is P states per device whatever the sequence length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks, _nonfinite, precision
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.feature_maps import make_feature_map
from linear_transformers.ops.linear import LinearState

IMPLS = ("quadratic", "associative_scan", "chunked", "scan")
DEFAULT_CHUNK_SIZE = 64


def default_chunk_size(platform: str | None = None, dtype="float32") -> int:
    """The chunk length C that `impl="chunked"` uses when none is given: 64, whatever the
    backend and dtype.

    The within-chunk [C, C] product costs T*C work, the between-chunk states (T/C)*F*M memory
    traffic; 64 won the `experiments.benchmark_attention` sweep on CPU (C = 32..256, float32,
    BENCHMARKS.md). Callers pass the backend and dtype so that a choice measured per backend
    and dtype can be made here; none is measured yet, so both are ignored.
    """
    del platform, dtype
    return DEFAULT_CHUNK_SIZE


def _normalise(num_xM, den_x, eps, dtype):
    return (num_xM / (den_x + eps)[..., None]).astype(dtype)


def _block_totals(phi_k_BTHF, v_BTHM, acc):
    """(sum_t phi(k_t) v_t^T, sum_t phi(k_t)) of a block: what it adds to the state."""
    return (
        precision.einsum_in(acc, "bthf,bthm->bhfm", phi_k_BTHF, v_BTHM),
        jnp.sum(phi_k_BTHF.astype(acc), axis=1),
    )


def _quadratic(phi_q_BTHF, phi_k_BTHF, v_BTHM, s0_BHFM, z0_BHF, *, eps, acc, chunk_size):
    del chunk_size
    T = phi_q_BTHF.shape[1]
    phi_q = phi_q_BTHF.astype(acc)
    sim_BHTS = jnp.einsum("bthf,bshf->bhts", phi_q, phi_k_BTHF.astype(acc))
    sim_BHTS = jnp.where(jnp.tril(jnp.ones((T, T), bool)), sim_BHTS, 0)
    num_BTHM = jnp.einsum("bhts,bshm->bthm", sim_BHTS, v_BTHM.astype(acc)) + jnp.einsum(
        "bthf,bhfm->bthm", phi_q, s0_BHFM
    )
    den_BTH = jnp.einsum("bhts->bth", sim_BHTS) + jnp.einsum("bthf,bhf->bth", phi_q, z0_BHF)
    ds_BHFM, dz_BHF = _block_totals(phi_k_BTHF, v_BTHM, acc)
    return _normalise(num_BTHM, den_BTH, eps, v_BTHM.dtype), (s0_BHFM + ds_BHFM, z0_BHF + dz_BHF)


def _associative_scan(phi_q_BTHF, phi_k_BTHF, v_BTHM, s0_BHFM, z0_BHF, *, eps, acc, chunk_size):
    del chunk_size
    kv_BTHFM = precision.einsum_in(acc, "bthf,bthm->bthfm", phi_k_BTHF, v_BTHM)
    s_BTHFM, z_BTHF = jax.lax.associative_scan(
        lambda a, b: jax.tree.map(jnp.add, a, b), (kv_BTHFM, phi_k_BTHF.astype(acc)), axis=1
    )
    s_BTHFM = s_BTHFM + s0_BHFM[:, None]
    z_BTHF = z_BTHF + z0_BHF[:, None]
    phi_q = phi_q_BTHF.astype(acc)
    num_BTHM = jnp.einsum("bthf,bthfm->bthm", phi_q, s_BTHFM)
    den_BTH = jnp.einsum("bthf,bthf->bth", phi_q, z_BTHF)
    return _normalise(num_BTHM, den_BTH, eps, v_BTHM.dtype), (s_BTHFM[:, -1], z_BTHF[:, -1])


def _exclusive_cumsum(x, axis):
    """Sum over chunks m < n along `axis`, by shifting rather than cumsum(x) - x, which would
    let chunk n's own (partly future) entries in up to rounding and break exact causality."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (1, 0)
    shifted = jnp.pad(jax.lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis), widths)
    return jnp.cumsum(shifted, axis=axis)


def segment_length(platform: str | None = None) -> int | None:
    """Steps per `lax.scan` iteration of the chunked form: None = one segment (all parallel).

    On CPU the chunked form runs over segments of ~512 steps in sequence, carrying (S, z), so
    each segment's blocks stay in cache: 1.4-1.6x faster at T=4k-16k (BENCHMARKS.md). GPUs and
    TPUs get every chunk at once.
    """
    platform = platform or jax.default_backend()
    return 512 if platform == "cpu" else None


def _chunked_segment(carry, xs, eps, acc):
    """One segment of the chunked form: its N chunks at once, after the state `carry`."""
    s0_BHFM, z0_BHF = carry
    q_BHNCF, k_BHNCF, v_BHNCM = xs
    C = q_BHNCF.shape[3]
    # Between chunks: state of everything before chunk n (exclusive prefix sum of chunk states).
    kv_BHNFM = precision.einsum_in(acc, "bhncf,bhncm->bhnfm", k_BHNCF, v_BHNCM)
    ksum_BHNF = jnp.sum(k_BHNCF.astype(acc), axis=3)
    s_BHNFM = _exclusive_cumsum(kv_BHNFM, axis=2) + s0_BHFM[:, :, None]
    z_BHNF = _exclusive_cumsum(ksum_BHNF, axis=2) + z0_BHF[:, :, None]

    # Within a chunk: the masked quadratic form on C x C (t, s: query and key position in it).
    sim_BHNCC = precision.einsum_in(acc, "bhntf,bhnsf->bhnts", q_BHNCF, k_BHNCF)
    sim_BHNCC = jnp.where(jnp.tril(jnp.ones((C, C), bool)), sim_BHNCC, 0)

    q_acc = q_BHNCF.astype(acc)
    num_BHNCM = jnp.einsum("bhnts,bhnsm->bhntm", sim_BHNCC, v_BHNCM.astype(acc)) + jnp.einsum(
        "bhncf,bhnfm->bhncm", q_acc, s_BHNFM
    )
    den_BHNC = jnp.sum(sim_BHNCC, axis=-1) + jnp.einsum("bhncf,bhnf->bhnc", q_acc, z_BHNF)
    out_BHNCM = _normalise(num_BHNCM, den_BHNC, eps, v_BHNCM.dtype)
    carry = (s0_BHFM + jnp.sum(kv_BHNFM, axis=2), z0_BHF + jnp.sum(ksum_BHNF, axis=2))
    return carry, out_BHNCM


def _chunked(phi_q_BTHF, phi_k_BTHF, v_BTHM, s0_BHFM, z0_BHF, *, eps, acc, chunk_size):
    B, T, H, F = phi_q_BTHF.shape
    M = v_BTHM.shape[-1]
    segment = segment_length()
    C = min(chunk_size, T)
    num_chunks = -(-T // C)
    # G segments of N chunks each, scanned in sequence (G = 1: everything in parallel).
    G = 1 if segment is None else max(1, -(-num_chunks * C // segment))
    N = -(-num_chunks // G)
    pad = G * N * C - T
    if pad:
        # Padding goes after every real step, and its phi(k) is 0, so it reaches neither a real
        # output nor the final state.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        phi_q_BTHF, phi_k_BTHF, v_BTHM = (jnp.pad(x, widths) for x in (phi_q_BTHF, phi_k_BTHF, v_BTHM))
    # Heads next to batch once, so every einsum is a batched matmul over (b, h, n) without a
    # transpose of its own; segments lead for the scan.
    xs = tuple(
        jnp.moveaxis(jnp.swapaxes(x, 1, 2).reshape(B, H, G, N, C, x.shape[-1]), 2, 0)
        for x in (phi_q_BTHF, phi_k_BTHF, v_BTHM)
    )
    carry = (s0_BHFM, z0_BHF)
    if G == 1:
        carry, out_GBHNCM = _chunked_segment(carry, tuple(x[0] for x in xs), eps, acc)
        out_GBHNCM = out_GBHNCM[None]
    else:
        # Rematerialised: the backward pass recomputes a segment's blocks while they are in
        # cache instead of storing them all (less memory, and faster at T >= 16k on CPU).
        segment_fn = jax.checkpoint(functools.partial(_chunked_segment, eps=eps, acc=acc))
        carry, out_GBHNCM = jax.lax.scan(segment_fn, carry, xs)
    out_BHTM = jnp.moveaxis(out_GBHNCM, 0, 2).reshape(B, H, G * N * C, M)
    return jnp.swapaxes(out_BHTM, 1, 2)[:, :T], carry


def _scan(phi_q_BTHF, phi_k_BTHF, v_BTHM, s0_BHFM, z0_BHF, *, eps, acc, chunk_size):
    del chunk_size

    def step(carry, xs):
        s_BHFM, z_BHF = carry
        phi_q_BHF, phi_k_BHF, v_BHM = (x.astype(acc) for x in xs)
        s_BHFM = s_BHFM + jnp.einsum("bhf,bhm->bhfm", phi_k_BHF, v_BHM)
        z_BHF = z_BHF + phi_k_BHF
        out_BHM = _normalise(
            jnp.einsum("bhf,bhfm->bhm", phi_q_BHF, s_BHFM),
            jnp.einsum("bhf,bhf->bh", phi_q_BHF, z_BHF),
            eps,
            v_BTHM.dtype,
        )
        return (s_BHFM, z_BHF), out_BHM

    time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (phi_q_BTHF, phi_k_BTHF, v_BTHM))
    carry, out_TBHM = jax.lax.scan(step, (s0_BHFM, z0_BHF), time_major)
    return jnp.swapaxes(out_TBHM, 0, 1), carry


def _finite_products(form):
    """`form` run on the finite part of v, NaN wherever a step sees a non-finite value (and in
    the columns of the final S it reaches): its masked products would otherwise turn a bad
    value at step s into NaN at every step (ops/_nonfinite.py)."""

    def guarded(phi_q_BTHF, phi_k_BTHF, v_BTHM, s0_BHFM, z0_BHF, **kw):
        result = form(phi_q_BTHF, phi_k_BTHF, _nonfinite.finite_part(v_BTHM), s0_BHFM, z0_BHF, **kw)

        def mark(result):
            out_BTHM, (s_BHFM, z_BHF) = result
            seen_BTHM = _nonfinite.seen_nonfinite_BTHM(v_BTHM, num_queries=v_BTHM.shape[1], causal=True)
            s_BHFM = _nonfinite.mark_seen(s_BHFM, jnp.any(seen_BTHM, axis=1)[:, :, None, :])
            return _nonfinite.mark_seen(out_BTHM, seen_BTHM), (s_BHFM, z_BHF)

        return _nonfinite.mark_unless_all_finite(v_BTHM, result, mark)

    return guarded


# The recurrent forms ("associative_scan", "scan") only ever add what a step can see. The
# guard wraps the whole chunked form, not just its within-chunk product: a state built from a
# non-finite value would still send NaN into earlier steps' gradients (0 * NaN in the backward
# pass of later steps' normalisation).
_FORMS = {
    "quadratic": _finite_products(_quadratic),
    "associative_scan": _associative_scan,
    "chunked": _finite_products(_chunked),
    "scan": _scan,
}


def _features(q_BTHD, k_BTHD, v_BTHM, fm, key_lengths, offset):
    """phi(q), phi(k) and v, with keys at global index >= key_lengths zeroed (they add nothing).

    `where`, not a product: padded values may hold inf or NaN.
    """
    phi_q_BTHF, phi_k_BTHF = fm.query(q_BTHD), fm.key(k_BTHD)
    if key_lengths is not None:
        valid_BT11 = (offset + jnp.arange(k_BTHD.shape[1])[None, :] < key_lengths[:, None])[:, :, None, None]
        phi_k_BTHF = jnp.where(valid_BT11, phi_k_BTHF, 0)
        v_BTHM = jnp.where(valid_BT11, v_BTHM, 0)
    return phi_q_BTHF, phi_k_BTHF, v_BTHM


def _one_device(q_BTHD, k_BTHD, v_BTHM, key_lengths, initial_state, *, fm, form, acc, **kw):
    phi_q, phi_k, v = _features(q_BTHD, k_BTHD, v_BTHM, fm, key_lengths, 0)
    out_BTHM, (s_BHFM, z_BHF) = form(phi_q, phi_k, v, *initial_state, acc=acc, **kw)
    return out_BTHM, LinearState(s_BHFM, z_BHF)


def _sequence_parallel(q_BTHD, k_BTHD, v_BTHM, key_lengths, initial_state, *, axis, fm, form, acc, **kw):
    """The local form: this device's block, after the blocks of the devices before it."""
    offset = sp.device_offset(axis, q_BTHD.shape[1])
    phi_q, phi_k, v = _features(q_BTHD, k_BTHD, v_BTHM, fm, key_lengths, offset)
    totals = _block_totals(phi_k, v, acc)
    before = sp.exclusive_prefix(jax.lax.all_gather(totals, axis), axis)
    s0_BHFM, z0_BHF = (x0 + b for x0, b in zip(initial_state, before))
    out_BTHM, _ = form(phi_q, phi_k, v, s0_BHFM, z0_BHF, acc=acc, **kw)
    # psum rather than the sum of the gathered totals: the same on every device by construction,
    # which shard_map can verify for a replicated output.
    final = LinearState(*(x0 + jax.lax.psum(t, axis) for x0, t in zip(initial_state, totals)))
    return out_BTHM, final


def check_linear_state(state, expected_BHFM, *, name: str) -> LinearState:
    """Raise a ValueError unless `state` is a LinearState of shapes S [B, H, F, M], z [B, H, F]."""
    if not isinstance(state, LinearState):
        raise ValueError(
            f"{name}: initial_state must be an ops.LinearState (init_linear_state, "
            f"or the state a call with return_state=True returned), got "
            f"{type(state).__name__}."
        )
    if tuple(state.s_BHFM.shape) != tuple(expected_BHFM) or tuple(state.z_BHF.shape) != tuple(
        expected_BHFM[:3]
    ):
        raise ValueError(
            f"{name}: initial_state shapes S {tuple(state.s_BHFM.shape)}, z "
            f"{tuple(state.z_BHF.shape)} do not fit the inputs, which need S {tuple(expected_BHFM)} "
            f"and z {tuple(expected_BHFM[:3])} (init_linear_state(batch, heads, F, M))."
        )
    for part in state:
        if not jnp.issubdtype(part.dtype, jnp.floating):
            raise ValueError(f"{name}: initial_state must be floating point, got {part.dtype}.")
    return state


def causal_linear_attention(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    feature_map="elu",
    impl="chunked",
    chunk_size=None,
    eps=1e-6,
    initial_state=None,
    return_state=False,
    key_lengths=None,
    sequence_axis=None,
):
    """Causal linear attention: query t attends to keys s <= t (and to the initial state).

    Args:
      q_BTHD, k_BTHD: [B, T, H, D]; v_BTHM: [B, T, H, M].
      feature_map: registered name, FeatureMap or callable (see `feature_maps`).
      impl: one of "quadratic", "associative_scan", "chunked", "scan" (see the module docstring);
        all give the same result for every T.
      chunk_size: chunk length C for impl="chunked" (>= 1; None: `default_chunk_size` for the
        default backend and the dtype of v); T need not be a multiple of it.
      eps: added to the normaliser.
      initial_state: an `ops.LinearState` (S [B, H, F, M], z [B, H, F]) the sequence continues
        from: `init_linear_state`, the state of `linear_attention_step`, or the state a previous
        call returned. None: zeros. Gradients flow into it.
      return_state: also return the state after the last step.
      key_lengths: int [B] in [0, T] (out of range: a ValueError eagerly, clamped under
        jit); keys at index >= key_lengths[b] add nothing, so a right-padded
        prompt returns the state after its real tokens (outputs at padded positions are those of
        the state so far and are not meaningful).
      sequence_axis: name of a mesh axis the time axis is split over. Inside `jax.shard_map`
        over it, pass this device's [B, T/P, ...] block: the result is the exact global result
        for it, `initial_state` is the global one, the returned state the global final state
        (the same on every device) and key_lengths are global indices. Outside `shard_map`,
        under `jax.set_mesh(mesh)`, the op wraps itself in one (T must split evenly over the
        axis). Under a mesh with explicit axis types, inputs whose time axis is sharded on a
        mesh axis run this way without being asked.

    Returns:
      out [B, T, H, M] in the dtype of v, or (out, LinearState) with return_state=True. States
      and normalisers are accumulated in float32 or wider.
    """
    name = "causal_linear_attention"
    if impl not in IMPLS:
        raise ValueError(f"{name}: unknown impl {impl!r}; expected one of {IMPLS}.")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{name}: chunk_size must be None or an integer >= 1, got {chunk_size!r}.")
    if not isinstance(return_state, bool):
        raise ValueError(f"{name}: return_state must be a bool, got {return_state!r}.")
    _checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if T != k_BTHD.shape[1]:
        raise ValueError(
            f"{name}: queries and keys must have the same length, got T={T} and S={k_BTHD.shape[1]}."
        )
    fm = make_feature_map(feature_map)
    M = v_BTHM.shape[-1]
    acc = _checks.accumulation_dtype(v_BTHM.dtype)
    key_lengths = _checks.check_key_lengths(key_lengths, B, name=name, length=T)
    if initial_state is None:
        initial_state = LinearState(
            jnp.zeros((B, H, fm.num_features(D), M), acc), jnp.zeros((B, H, fm.num_features(D)), acc)
        )
    else:
        check_linear_state(initial_state, (B, H, fm.num_features(D), M), name=name)
        acc = jnp.promote_types(acc, jnp.result_type(*initial_state))
        initial_state = LinearState(*(x.astype(acc) for x in initial_state))
    if T == 0:  # Nothing to attend to: no outputs, and the state passes through unchanged.
        out = jnp.zeros((B, 0, H, M), v_BTHM.dtype)
        return (out, initial_state) if return_state else out
    if chunk_size is None:
        chunk_size = default_chunk_size(jax.default_backend(), v_BTHM.dtype)
    kw = dict(fm=fm, form=_FORMS[impl], acc=acc, eps=eps, chunk_size=chunk_size)
    if sequence_axis is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BTHD, v_BTHM, name=name)
    if sequence_axis is None:
        initial_state = sp.match_batch_sharding(initial_state, q_BTHD)
        out, state = _one_device(q_BTHD, k_BTHD, v_BTHM, key_lengths, initial_state, **kw)
    else:
        if not sp.is_manual(sequence_axis):
            sp.check_sequence_axis(sequence_axis, T, name=name)
        else:
            sp.axis_size(sequence_axis)
        local = functools.partial(_sequence_parallel, axis=sequence_axis, **kw)
        out, state = sp.call_over_sequence(
            local,
            sequence_axis,
            (q_BTHD, k_BTHD, v_BTHM, key_lengths, initial_state),
            (sp.TIME, sp.TIME, sp.TIME, sp.BATCH, sp.BATCH),
            (sp.TIME, sp.BATCH),
            batch=B,
        )
    return (out, state) if return_state else out
