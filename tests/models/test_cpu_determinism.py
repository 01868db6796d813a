"""The same model on the same batch gives the same logits, call after call, on the CPU.

jaxlib 0.10.2's XLA:CPU, with its YNNPACK reduction fusions on, gave a 2-layer "linear" CausalLM
called eagerly on one batch of 64 nondeterministic logits, and all NaN in about 1 call of 8
(it spoilt a held-out evaluation: NaN loss, recall 0). The tests and the entry points turn those
fusions off before JAX starts (tests/conftest.py, experiments/__init__.py); this fails when they
are on (checked: 2 runs of 2).
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_transformers import CausalLM, TransformerConfig


def test_a_linear_lm_repeats_its_logits_exactly():
    config = TransformerConfig(
        num_layers=2, num_heads=2, model_dim=64, feed_forward_dim=128, dropout=0.0, attention="linear"
    )
    model = CausalLM(config, 256, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (64, 64)), jnp.int32)
    first = np.asarray(model(tokens))
    assert np.isfinite(first).all()
    for _ in range(7):
        np.testing.assert_array_equal(np.asarray(model(tokens)), first)
