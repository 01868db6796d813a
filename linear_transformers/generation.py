"""Compiled recurrent inference: any module with `step(state, x) -> (state, y)`.

`nnx.split` happens once outside `jit`; inside, `nnx.merge` rebuilds the module (the Flax
performance guide's recommended pattern), so a whole sequence runs as one `lax.scan`.

  state, ys_BT = scan_steps(module, state, xs_BT)        `step` over time, one compiled loop
  tokens_BT = generate(model, prompt_BT, num_steps, key=key)   prompt read by one `prefill`,
                                                        then num_steps tokens sampled step by step
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers.finite import check_finite_outputs, check_finite_parameters
from linear_transformers.lm import check_token_ids


def make_step_fn(module: nnx.Module):
    """Return (step_fn, params): `step_fn(params, state, x) -> (state, y)`, jit-compiled.

    Use it as a `lax.scan` body with `lambda state, x: step_fn(params, state, x)`.
    """
    graphdef, params = nnx.split(module)

    @jax.jit
    def step_fn(params, state, x):
        return nnx.merge(graphdef, params).step(state, x)

    return step_fn, params


@functools.partial(jax.jit, static_argnums=0)
def _scan_steps(graphdef, params, state, xs_TB):
    module = nnx.merge(graphdef, params)
    return jax.lax.scan(module.step, state, xs_TB)


def scan_steps(module: nnx.Module, state, xs_BT):
    """Run `module.step` over the time axis 1 of `xs_BT` (a pytree) in one compiled loop.

    Returns (final_state, ys_BT) with outputs stacked on axis 1.
    """
    graphdef, params = nnx.split(module)
    xs_TB = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs_BT)
    state, ys_TB = _scan_steps(graphdef, params, state, xs_TB)
    return state, jax.tree.map(lambda y: jnp.swapaxes(y, 0, 1), ys_TB)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _generate(graphdef, params, prompt_BT, key, num_steps, temperature):
    model = nnx.merge(graphdef, params)
    B, T = prompt_BT.shape
    state = model.init_state(B, max_length=T + num_steps)
    # All but the last prompt token in one parallel pass; the sampling loop reads the last one.
    if T > 1:
        if hasattr(model, "prefill"):
            state, _ = model.prefill(state, prompt_BT[:, :-1])
        else:  # A module with only `step`: read the prompt token by token.
            state, _ = jax.lax.scan(model.step, state, prompt_BT[:, :-1].T)

    def sample_step(carry, key_t):
        state, token_B, finite_B = carry
        state, logits_BV = model.step(state, token_B)
        greedy = jnp.argmax(logits_BV, axis=-1)
        sampled = jax.random.categorical(key_t, logits_BV / jnp.maximum(temperature, 1e-6))
        next_B = jnp.where(temperature > 0, sampled, greedy).astype(prompt_BT.dtype)
        # argmax and categorical return a valid id for NaN logits: remember that they were not.
        finite_B = finite_B & jnp.all(jnp.isfinite(logits_BV), axis=-1)
        return (state, next_B, finite_B), next_B

    keys = jax.random.split(key, num_steps)
    carry = (state, prompt_BT[:, -1], jnp.ones((B,), bool))
    (_, _, finite_B), new_TB = jax.lax.scan(sample_step, carry, keys)
    return jnp.concatenate([prompt_BT, new_TB.T], axis=1), finite_B


def generate(model: nnx.Module, prompt_BT, num_steps: int, *, key, temperature: float = 1.0):
    """Sample `num_steps` tokens after `prompt_BT` (at least one token) in one compiled loop.

    `model` needs `init_state(batch, max_length=)` and `step(state, token_B) -> (state, logits_BV)`
    (e.g. `CausalLM`), and must be in eval mode. The prompt, all but its last token, is read by
    one `prefill(state, tokens_BT)` where the model has one (token by token otherwise); the
    sampling loop then steps from its last token. temperature=0 decodes greedily.
    Returns [B, T + num_steps] tokens. Parameters or logits holding NaN or inf are a
    FloatingPointError (inside `jit` the parameters cannot be read: only the logits are).
    """
    prompt_BT = jnp.asarray(prompt_BT)
    if prompt_BT.ndim != 2 or prompt_BT.shape[1] < 1:
        raise ValueError(
            f"generate: prompt must be [batch, length >= 1] tokens, got shape {tuple(prompt_BT.shape)}."
        )
    if num_steps < 0:
        raise ValueError(f"generate: num_steps must be >= 0, got {num_steps}.")
    if temperature < 0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}.")
    embed = getattr(model, "embed", None)
    if isinstance(getattr(embed, "num_embeddings", None), int):
        check_token_ids(prompt_BT, embed.num_embeddings, "generate", "prompt tokens")
    check_finite_parameters(model, "generate")
    graphdef, params = nnx.split(model)
    tokens_BT, finite_B = _generate(graphdef, params, prompt_BT, key, num_steps, jnp.float32(temperature))
    check_finite_outputs(finite_B, "generate")
    return tokens_BT
