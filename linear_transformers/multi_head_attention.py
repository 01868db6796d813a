"""Multi-head attention for every registered attention kind, parallel and recurrent.

Legend: B batch, T query time, S key time, E input features, H heads, D key/query features per
head, M value features per head.

The same parameters serve three uses:

  y_BTE = mha(x_BTE)                                   self-attention, parallel (training)
  y_BTE = mha(x_BTE, segment_ids=ids_BT)               packed sequences, each alone
  y_BTE = mha(x_BTE, context_BSE, key_lengths=...)     cross-attention, parallel
  state = mha.init_state(batch, max_length=...)        causal self-attention as an RNN:
  state, y_BE = mha.step(state, x_BE)                  one token at a time,
  state, y_BTE = mha.prefill(state, x_BTE)             or a block of T in parallel form
  memory = mha.init_memory(context_BSE, key_lengths)   cross-attention over a fixed memory:
  y_BE = mha.attend_memory(memory, x_BE)               its keys/values computed once
                                                       (x_BTE: a block of queries)
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
from flax import nnx

from linear_transformers.attention.base import keyword_state_arguments, kinds_with, make_attention_core
from linear_transformers.core_options import core_options


class MultiHeadAttention(nnx.Module):
    """Projections to H heads, an attention core chosen by `kind`, and an output projection.

    Args:
      in_features: E, width of the queries' input.
      num_heads: H.
      query_dim: D per head; default in_features // num_heads (which must then divide).
      value_dim: M per head; default query_dim.
      kind: registered attention kind ("softmax", "linear", "causal-linear", "reformer",
        "linformer", ...; `registered_attention_kinds()`).
      causal: whether query t sees only keys s <= t (self-attention in a decoder).
      kv_features: width of the keys'/values' input (context); default in_features.
      out_features: width of the output; default in_features.
      attention_dropout, softmax_temp: options of the core when set; a kind that has no
        attention matrix or temperature rejects them rather than ignore them.
      attention_options: further options of the kind, a mapping (e.g. {"feature_map": "favor"})
        or an instance of its options class (`attention.LinearOptions(feature_map="favor")`,
        `attention_class(kind).options_class`). Built into that class once, here: an option the
        kind does not take, or an unusable value, is a ValueError listing what it accepts.
      sequence_axis: mesh axis to split time over in the parallel form (sequence parallelism;
        kinds with `has_sequence_parallel_form` only), or None.
      dtype: computation dtype of the projections (None: from inputs and parameters); the
        cores keep softmax, states and normalisers in float32 whatever it is.
      param_dtype: storage dtype of the projections and of the core's own parameters.
    """

    def __init__(
        self,
        in_features: int,
        num_heads: int,
        *,
        query_dim: int | None = None,
        value_dim: int | None = None,
        kind: str = "softmax",
        causal: bool = False,
        kv_features: int | None = None,
        out_features: int | None = None,
        attention_dropout: float = 0.0,
        softmax_temp: float | None = None,
        attention_options: Mapping[str, Any] | Any | None = None,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        sequence_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}.")
        if query_dim is None:
            if in_features % num_heads:
                raise ValueError(
                    f"in_features={in_features} is not divisible by num_heads={num_heads}; "
                    "choose a width that divides or give query_dim (per head) explicitly."
                )
            query_dim = in_features // num_heads
        value_dim = query_dim if value_dim is None else value_dim
        kv_features = in_features if kv_features is None else kv_features
        out_features = in_features if out_features is None else out_features
        self.num_heads, self.query_dim, self.value_dim = num_heads, query_dim, value_dim
        self.causal = causal
        self.dtype = dtype

        self.core = make_attention_core(
            kind,
            causal=causal,
            num_heads=num_heads,
            head_dim=query_dim,
            value_dim=value_dim,
            rngs=rngs,
            sequence_axis=sequence_axis,
            in_features=in_features,
            dtype=dtype,
            param_dtype=param_dtype,
            options=core_options(
                kind, attention_options, attention_dropout=attention_dropout, softmax_temp=softmax_temp
            ),
        )

        def linear(i, o):
            return nnx.Linear(i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.query = linear(in_features, num_heads * query_dim)
        # Shared-QK kinds (reformer) derive keys from the queries: a key projection would be
        # parameters that never receive a gradient.
        self.key = None if self.core.shares_query_key else linear(kv_features, num_heads * query_dim)
        self.value = linear(kv_features, num_heads * value_dim)
        self.out = linear(num_heads * value_dim, out_features)

    def _check_input(self, x, what: str, features: int, *, time: bool = True, batch: int | None = None):
        """A ValueError naming `what` unless x is [batch, time, features] ([batch, features]
        without `time`), with `batch` rows where given: here, not as a product's shape error."""
        layout = ("batch", "time", str(features)) if time else ("batch", str(features))
        shape = getattr(x, "shape", None)
        if (
            shape is None
            or len(shape) != len(layout)
            or shape[-1] != features
            or (batch is not None and shape[0] != batch)
        ):
            rows = "" if batch is None else f" with the queries' batch of {batch}"
            got = f"shape {tuple(shape)}" if shape is not None else f"a {type(x).__name__}"
            raise ValueError(
                f"MultiHeadAttention ({self.core.kind!r}): {what} must be [{', '.join(layout)}]{rows}, "
                f"got {got}."
            )

    def _heads(self, proj, x, dim):
        return proj(x).reshape(x.shape[:-1] + (self.num_heads, dim))

    def _merge(self, y_xHM):
        return self.out(y_xHM.reshape(y_xHM.shape[:-2] + (-1,)))

    def __call__(
        self,
        x_BTE,
        context_BSE=None,
        *,
        key_lengths=None,
        mask=None,
        segment_ids=None,
        context_segment_ids=None,
        positions=None,
    ):
        """Parallel attention of x over itself, or over `context` when given.

        key_lengths: int [B], number of valid keys (padding is at the end).
        mask: boolean [T, S] or [B, H, T, S] (size-1 dimensions broadcast; True = attend); only
          kinds that form the T x S matrix (softmax) accept it.
        segment_ids: int [B, T] of packed sequences (0 = padding): each segment attends only to
          itself; with a context, `context_segment_ids` [B, S] are its ids (kinds with
          `supports_segments`).
        positions: int [B, T], the position of each token in its sequence (kinds that use
          positions; default: from the segment ids, else 0..T-1).
        """
        if self.causal and context_BSE is not None:
            raise ValueError(
                "causal attention is self-attention; got a context. Build the "
                "cross-attention layer with causal=False."
            )
        if self.key is None and context_BSE is not None:
            raise ValueError(
                f"attention kind {self.core.kind!r} shares queries and keys, so it is "
                "self-attention only; got a context. Use another kind for "
                "cross-attention."
            )
        self._check_input(x_BTE, "x", self.query.in_features)
        if context_BSE is not None:
            self._check_input(context_BSE, "context", self.value.in_features, batch=x_BTE.shape[0])
        extra = self._segments(segment_ids, context_segment_ids, cross=context_BSE is not None)
        if self.core.takes_inputs:
            extra.update(x=x_BTE, positions=positions)
        context_BSE = x_BTE if context_BSE is None else context_BSE
        q_BTHD = self._heads(self.query, x_BTE, self.query_dim)
        k_BSHD = q_BTHD if self.key is None else self._heads(self.key, context_BSE, self.query_dim)
        v_BSHM = self._heads(self.value, context_BSE, self.value_dim)
        return self._merge(self.core(q_BTHD, k_BSHD, v_BSHM, key_lengths=key_lengths, mask=mask, **extra))

    def _segments(self, segment_ids, context_segment_ids, *, cross: bool) -> dict:
        """The segment keywords for the core, or a ValueError saying what is missing."""
        if segment_ids is None and context_segment_ids is None:
            return {}
        if not self.core.supports_segments:
            raise ValueError(
                f"attention kind {self.core.kind!r} takes no segment_ids (packed sequences); "
                f"kinds that do: {kinds_with('supports_segments')}."
            )
        if segment_ids is None:
            raise ValueError("context_segment_ids given without segment_ids (the queries' ids).")
        if not cross:
            if context_segment_ids is not None:
                raise ValueError("context_segment_ids are for cross-attention; got no context.")
            return {"segment_ids": segment_ids}
        if context_segment_ids is None:
            raise ValueError(
                "cross-attention over a packed context needs context_segment_ids, the context's "
                "segment ids, beside segment_ids (the queries')."
            )
        return {"segment_ids": segment_ids, "key_segment_ids": context_segment_ids}

    @keyword_state_arguments
    def init_state(self, batch: int, *, max_length: int | None = None, dtype=None):
        """Recurrent state of causal self-attention (a KV cache of `max_length` for softmax).
        `dtype` (of a KV cache) defaults to the layer's dtype, or float32 when that is None;
        linear states are float32 at least whatever it is."""
        if dtype is None:
            dtype = jnp.float32 if self.dtype is None else self.dtype
        return self.core.init_state(batch, max_length=max_length, dtype=dtype)

    def step(self, state, x_BE):
        """One token of causal self-attention: (state, x_t) -> (state, y_t)."""
        self._check_input(x_BE, "x", self.query.in_features, time=False)
        q_BHD = self._heads(self.query, x_BE, self.query_dim)
        k_BHD = q_BHD if self.key is None else self._heads(self.key, x_BE, self.query_dim)
        v_BHM = self._heads(self.value, x_BE, self.value_dim)
        extra = {"x": x_BE} if self.core.takes_inputs else {}
        state, y_BHM = self.core.step(state, q_BHD, k_BHD, v_BHM, **extra)
        return state, self._merge(y_BHM)

    def prefill(self, state, x_BTE, *, key_lengths=None, segment_ids=None, positions=None):
        """T tokens of causal self-attention at once, from `state`: -> (state, y [B, T, E]).

        The parallel form over the block, continuing from the state of the tokens before it
        (from `init_state`, `step` or `prefill`), and returning the state after it: equal to T
        calls of `step`. key_lengths int [B] (linear kinds): tokens at index >= key_lengths[b]
        leave the state as it was after the real ones. segment_ids int [B, T]: a packed block,
        whose first segment continues the state and whose last one decoding continues.
        """
        self._check_input(x_BTE, "x", self.query.in_features)
        extra = self._segments(segment_ids, None, cross=False)
        if self.core.takes_inputs:
            extra.update(x=x_BTE, positions=positions)
        q_BTHD = self._heads(self.query, x_BTE, self.query_dim)
        k_BTHD = q_BTHD if self.key is None else self._heads(self.key, x_BTE, self.query_dim)
        v_BTHM = self._heads(self.value, x_BTE, self.value_dim)
        state, y_BTHM = self.core.prefill(state, q_BTHD, k_BTHD, v_BTHM, key_lengths=key_lengths, **extra)
        return state, self._merge(y_BTHM)

    def init_memory(self, context_BSE, key_lengths=None):
        """Project a fixed memory once, for `attend_memory` at every decoding step."""
        if self.key is None:
            raise self.core._no_memory_form("init_memory")
        self._check_input(context_BSE, "context", self.value.in_features)
        k_BSHD = self._heads(self.key, context_BSE, self.query_dim)
        v_BSHM = self._heads(self.value, context_BSE, self.value_dim)
        return self.core.init_memory(k_BSHD, v_BSHM, key_lengths)

    def attend_memory(self, memory, x):
        """Cross-attention over a memory from `init_memory` of one query per batch element,
        x [B, E] -> [B, E_out], or of a block of queries, x [B, T, E] -> [B, T, E_out]."""
        if x.ndim not in (2, 3):
            raise ValueError(
                f"attend_memory: x must be [batch, features] (one step) or "
                f"[batch, time, features] (a block), got shape {tuple(x.shape)}."
            )
        return self._merge(self.core.attend_memory(memory, self._heads(self.query, x, self.query_dim)))
