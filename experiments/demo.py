"""Tiny end-to-end demo: train a causal transformer, then generate with its recurrent form.

  python -m experiments.demo --config configs/demo.py [--config.attention=softmax]

`main` parses flags and calls `train_and_evaluate(config, workdir)`, which tests call too.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from linear_transformers.generation import generate, scan_steps
from linear_transformers.lm import CausalLM
from linear_transformers.transformer import TransformerConfig

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Demo configuration.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where to write metrics.json (optional).")


def progressions(key, batch: int, length: int, vocab: int):
    """[batch, length] sequences a + t*d mod vocab with random start a and step d."""
    start_key, step_key = jax.random.split(key)
    a = jax.random.randint(start_key, (batch, 1), 0, vocab)
    d = jax.random.randint(step_key, (batch, 1), 1, vocab)
    return (a + d * jnp.arange(length)[None, :]) % vocab


def _model_config(config) -> TransformerConfig:
    return TransformerConfig(
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        model_dim=config.model_dim,
        feed_forward_dim=config.feed_forward_dim,
        dropout=config.dropout,
        attention=config.attention,
        attention_options=dict(config.attention_options),
    )


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | None = None) -> dict:
    """Train on fresh random progressions; return loss, accuracy and the parallel/recurrent gap."""
    train_key, test_key = jax.random.split(jax.random.key(config.seed))
    model = CausalLM(
        _model_config(config), config.vocab_size, rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    )
    optimizer = nnx.Optimizer(model, optax.adamw(config.learning_rate), wrt=nnx.Param)

    def loss_fn(model, tokens_BT):
        logits_BTV = model(tokens_BT[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]).mean()

    @nnx.jit
    def train_step(model, optimizer, tokens_BT):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens_BT)
        optimizer.update(model, grads)
        return loss

    start = time.perf_counter()
    losses = []
    for step in range(1, config.num_steps + 1):
        tokens = progressions(
            jax.random.fold_in(train_key, step), config.batch_size, config.seq_len, config.vocab_size
        )
        loss = train_step(model, optimizer, tokens)
        if step % config.log_every == 0 or step == config.num_steps:
            losses.append(float(loss))
            print(
                f"step {step:5d}  loss {losses[-1]:.4f}  {step / (time.perf_counter() - start):.1f} steps/s",
                flush=True,
            )
    train_seconds = time.perf_counter() - start

    model.eval()
    test = progressions(test_key, config.eval_batch_size, config.seq_len, config.vocab_size)
    # Greedy continuation, generated one token at a time by the recurrent form.
    generated = generate(
        model, test[:, : config.prompt_len], config.seq_len - config.prompt_len, key=test_key, temperature=0.0
    )
    accuracy = float(jnp.mean(generated[:, config.prompt_len :] == test[:, config.prompt_len :]))
    # The same weights, parallel and recurrent, must give the same logits.
    parallel = model(test)
    _, recurrent = scan_steps(model, model.init_state(test.shape[0], test.shape[1]), test)
    gap = float(jnp.max(jnp.abs(parallel - recurrent)))
    metrics = {
        "attention": config.attention,
        "final_loss": losses[-1],
        "continuation_accuracy": accuracy,
        "parallel_vs_recurrent_max_abs_diff": gap,
        "train_seconds": round(train_seconds, 1),
        "steps": config.num_steps,
    }
    print(json.dumps(metrics, indent=2))
    print(
        "example prompt -> continuation:",
        test[0, : config.prompt_len].tolist(),
        "->",
        generated[0, config.prompt_len :].tolist(),
    )
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
