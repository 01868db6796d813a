"""The trainer's optimizer: decoupled weight decay reaches every parameter but the delta rule's
decay rates (`attention.NO_WEIGHT_DECAY`, as FLA's layers mark them)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from experiments.training.optimizer import make_optimizer
from linear_transformers import attention


def test_weight_decay_leaves_the_decay_rates_alone():
    core = attention.make_attention_core(
        "gated-deltanet", causal=True, num_heads=2, head_dim=4, value_dim=4, rngs=nnx.Rngs(0), in_features=8
    )
    _, params, _ = nnx.split(core, nnx.Param, ...)
    config = ml_collections.ConfigDict(
        dict(optimizer="adamw", grad_clip=1.0, weight_decay=0.1, learning_rate=0.5, schedule="constant",
             warmup_steps=0, num_steps=10)
    )  # fmt: skip
    tx = make_optimizer(config)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    moved = {
        jax.tree_util.keystr(path): float(jnp.max(jnp.abs(u)))
        for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
    }
    kept = {name for name, size in moved.items() if size == 0}
    assert kept == {"['A_log'].value", "['dt_bias'].value"}, moved
    # Everything else decays by learning rate x weight decay, the gradients being zero.
    kernel, update = params["decay_projection"]["kernel"][...], updates["decay_projection"]["kernel"][...]
    np.testing.assert_allclose(update, -0.5 * 0.1 * kernel, rtol=1e-6)
