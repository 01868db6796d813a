"""Cases the tests share: small models of each attention kind, a FAVOR+ feature map without a
compile of its QR, and a `jit` without XLA's optimisation passes.

Legend: D key/query features, F feature-map features.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from linear_transformers import TransformerConfig, ops

FAVOR = {"feature_map": "favor", "num_features": 16}

# name -> (attention kind, its options): the kinds a model-level test runs through.
MODEL_KINDS = {
    "softmax": ("softmax", {}),
    "linear": ("linear", {}),
    "causal-linear": ("causal-linear", {}),
    "favor": ("linear", FAVOR),
    "relu": ("linear", {"feature_map": "relu"}),
}


def chunk_size_for(implementation: str, chunk_size):
    """A test's chunk length for `implementation`: the GPU kernel ("pallas") takes powers of two
    from 16, the other forms any length (or ignore it)."""
    return max(16, chunk_size) if implementation == "pallas" and chunk_size is not None else chunk_size


# Tests of ops compile many small programs: XLA's optimisation passes cost more than they save.
unoptimised_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def small_config(attention="linear", options=None, **overrides) -> TransformerConfig:
    """A one-layer model of `attention` (a kind, or a name of `MODEL_KINDS`), two heads unless
    overridden, no dropout, with `options` (the kind's, or the name's) and any field overridden."""
    if options is None and attention in MODEL_KINDS:
        attention, options = MODEL_KINDS[attention]
    fields = dict(
        num_layers=1,
        num_heads=2,
        model_dim=16,
        feed_forward_dim=32,
        dropout=0.0,
        attention=attention,
        attention_options=dict(options or {}),
    )
    return TransformerConfig(**{**fields, **overrides})


def favor_map(num_features: int, head_dim: int, seed: int = 42) -> ops.FavorFeatureMap:
    """FAVOR+ with an explicit Gaussian projection [num_features, head_dim]: `favor_projection`'s
    QR would compile op by op (seconds)."""
    return ops.FavorFeatureMap(np.random.default_rng(seed).standard_normal((num_features, head_dim)))
