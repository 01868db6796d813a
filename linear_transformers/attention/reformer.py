"""`"reformer"` attention: Reformer's LSH attention, the paper's baseline (`ops.lsh`).

Legend: B batch, T query time, S key time, H heads, D key/query features per head, M value
features per head, R hashing rounds, U buckets, C chunk length.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from linear_transformers import ops
from linear_transformers.attention.base import AttentionCore, register_attention


class HashRotations(nnx.Variable):
    """The fixed random rotations of LSH attention: state, not a trained parameter."""


@dataclasses.dataclass(frozen=True)
class ReformerOptions:
    """Options of `"reformer"` attention (checked by `ops.check_lsh_options`).

    Attributes:
      num_buckets: U, 1 or even (default 8).
      num_rounds: R hashing rounds (default 4; the paper compares 1, 4 and 8).
      chunk_size: C, each query sees its chunk and the previous one in sorted order (default 32).
      softmax_temp: logit scale, default 1/sqrt(head_dim).
    """

    num_buckets: int = 8
    num_rounds: int = 4
    chunk_size: int = 32
    softmax_temp: float | None = None

    def __post_init__(self):
        checked = ops.check_lsh_options(
            num_rounds=self.num_rounds, num_buckets=self.num_buckets, chunk_size=self.chunk_size
        )
        for name, value in zip(("num_rounds", "num_buckets", "chunk_size"), checked):
            object.__setattr__(self, name, value)  # numpy integers stored as ints


@register_attention("reformer")
class ReformerAttention(AttentionCore):
    """Reformer's LSH attention, the paper's baseline (see `ops.lsh` for the exact definition).

    Queries and keys are shared: the keys are the unit-normalised queries, so this kind is
    self-attention only and `MultiHeadAttention` builds no key projection for it. Causal or not;
    key_lengths padding is honoured; arbitrary masks are not.

    Options: `ReformerOptions`.

    The rotations are drawn once from the `params` RNG stream and kept (so evaluation is
    deterministic); `redraw_hashes(key)` draws new ones.
    """

    options_class = ReformerOptions
    shares_query_key = True
    no_recurrent_form_reason = (
        "which keys share a chunk depends on the hash-sorted order of the "
        "whole sequence, so no per-token state reproduces the parallel form"
    )

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        # No sequence-parallel form (the hash-sorted chunks span the whole sequence): the base
        # class rejects a sequence_axis with the list of kinds that have one.
        super().__init__(rngs=rngs, **kwargs)
        options = self.options
        self.chunk_size = options.chunk_size
        self.softmax_temp = options.softmax_temp
        self.rotations = HashRotations(
            ops.lsh_rotations(rngs.params(), options.num_rounds, self.head_dim, options.num_buckets)
        )

    def redraw_hashes(self, key):
        """Draw new random rotations (same rounds and buckets)."""
        R, D, half = self.rotations[...].shape
        self.rotations.set_value(ops.lsh_rotations(key, R, D, max(1, 2 * half)))

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        if mask is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot honour an arbitrary [T, S] mask; use "
                "key_lengths for padding and causal=True for causality."
            )
        if k_BSHD is not q_BTHD:
            raise ValueError(
                f"{self.kind!r} attention shares queries and keys (its keys are the "
                "normalised queries), so it takes k=q: self-attention only. Use "
                "another kind for cross-attention."
            )
        return ops.lsh_attention(
            q_BTHD,
            v_BSHM,
            self.rotations[...],
            chunk_size=self.chunk_size,
            causal=self.causal,
            key_lengths=key_lengths,
            scale=self.softmax_temp,
        )
