"""Causal linear attention (the paper's), in four forms that compute the same thing, from any
starting state: `gated_linear_attention` with the elu feature map, the normaliser, scale 1 and no
decay (its forms are in the package `gated_linear`, one file each).

Legend: B batch, T query time, S key time (the same positions: causal self-attention), H
heads, D key/query features, F feature-map features, M value features, C chunk length, N number
of chunks, G segments of chunks (the chunked form's `lax.scan` on CPU), P devices on the
sequence axis; `x` in a suffix: any leading shape.

  out_t = phi(q_t) . s_t / (phi(q_t) . z_t + eps),  s_t = s_0 + sum_{i<=t} phi(k_i) v_i^T,
                                                     z_t = z_0 + sum_{i<=t} phi(k_i)

(s_0, z_0) is the `initial_state` (zero by default): the state the RNN form would hold after
the tokens before this block, so a prompt, or a long sequence cut into segments, is processed in
parallel and carried on from where it ended (`return_state=True` gives (s_T, z_T);
`causal_linear_attention_prefill` takes the state first and returns it first, as a step does).

- "reference": the masked [T, T] product; O(T^2) time and memory.
- "associative_scan": `jax.lax.associative_scan` of the prefix states; O(T log T) work but one
  [F, M] state per position in memory.
- "chunked": within a chunk of C steps the masked [C, C] product, between chunks the prefix sum of
  per-chunk states; O(T*C + (T/C)*F*M) memory, matmul-shaped work. The default. On CPU the
  chunks go in segments of `segment_length()` steps through a `lax.scan` carrying (s, z), which
  keeps each segment in cache. Feature maps, masking and relayout happen a segment at a time,
  and the backward pass recomputes each segment from the state entering it rather than storing
  it (`gated_linear/chunk_segments.py`): forward+backward keeps the inputs and one state per
  segment.
- "scan": the RNN, `lax.scan` of the (s, z) update; O(F*M) state, T sequential steps.
- "pallas": the chunked recurrence as a Pallas kernel, one program per (batch, head) carrying
  its state on chip (a Triton kernel on a GPU; Pallas's interpreter on a CPU, for tests);
  `gated_linear/pallas.py`.

With `sequence_axis`, the time axis is split over the devices of a mesh axis (LASP-2, Sun et al.
2025): each device reduces its block to its (s, z) totals, one all-gather shares these F x M
states, and each device finishes its own block from the exclusive prefix of the devices before
it. The traffic is P states per device whatever the sequence length.
"""

from __future__ import annotations

from linear_transformers import _deprecation
from linear_transformers.ops.gated_linear.op import attend, keep_dtypes
from linear_transformers.ops.linear_state import LinearState


@_deprecation.renamed_keyword("impl", "implementation")
def causal_linear_attention(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    feature_map="elu",
    implementation="chunked",
    chunk_size=None,
    eps=1e-6,
    initial_state=None,
    return_state=False,
    key_lengths=None,
    segment_ids=None,
    sequence_axis=None,
):
    """Causal linear attention: query t attends to keys s <= t (and to the initial state).

    Args:
      q_BTHD, k_BTHD: [B, T, H, D]; v_BTHM: [B, T, H, M].
      feature_map: registered name, FeatureMap or callable (see `feature_maps`).
      implementation: one of `LINEAR_IMPLEMENTATIONS`, "reference", "associative_scan",
        "chunked", "scan", "pallas" (the GPU kernel; see the module docstring); all give the
        same result for every T.
      chunk_size: chunk length C for implementation="chunked" (>= 1; None:
        `DEFAULT_CHUNK_SIZE`) or "pallas" (a power of two >= 16); T need not be a multiple of it.
      eps: added to the normaliser: a number >= 0, or a scalar array.
      initial_state: an `ops.LinearState` (s [B, H, F, M], z [B, H, F]) the sequence continues
        from: `init_linear_state`, the state of `linear_attention_step`, or the state a previous
        call returned. None: zeros. Gradients flow into it.
      return_state: also return the state after the last step.
      key_lengths: int [B] in [0, T] (out of range: a ValueError eagerly, clamped under
        jit); keys at index >= key_lengths[b] add nothing, so a right-padded
        prompt returns the state after its real tokens (outputs at padded positions are those of
        the state so far and are not meaningful).
      segment_ids: int [B, T] of packed sequences, 0 = padding: the state (s, z) is dropped
        where the id changes, so each segment is computed alone (`gated_linear_attention`).
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
    return attend(
        q_BTHD,
        k_BTHD,
        v_BTHM,
        log_decay=None,
        feature_map=feature_map,
        normalize=True,
        scale=1.0,
        implementation=implementation,
        chunk_size=chunk_size,
        eps=eps,
        initial_state=initial_state,
        return_state=return_state,
        key_lengths=key_lengths,
        segment_ids=segment_ids,
        sequence_axis=sequence_axis,
        name="causal_linear_attention",
    )


@_deprecation.renamed_keyword("impl", "implementation")
def causal_linear_attention_prefill(state: LinearState, q_BTHD, k_BTHD, v_BTHM, **kwargs):
    """A block of T causal steps from `state`, in parallel form: -> (state, out [B, T, H, M]).

    Equal to T calls of `linear_attention_step` (up to rounding) and leaves the state they
    would leave; the state keeps its dtypes, so it stays a valid `lax.scan` carry. `kwargs` are
    those of `causal_linear_attention` (feature_map, implementation, chunk_size, eps, key_lengths,
    segment_ids, sequence_axis): with key_lengths, the state after each example's real tokens.
    """
    out_BTHM, new_state = causal_linear_attention(
        q_BTHD, k_BTHD, v_BTHM, initial_state=state, return_state=True, **kwargs
    )
    return keep_dtypes(new_state, state), out_BTHM
