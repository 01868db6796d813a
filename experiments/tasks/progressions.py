"""The demo task: a small causal transformer learns arithmetic progressions, then continues
them with its recurrent form (`Progressions`).

Each sequence is a, a+d, a+2d, ... (mod vocab_size) with random a and d; evaluation gives the
model `prompt_len` tokens and decodes the rest greedily, one token at a time with the
recurrent form, and checks that the parallel and recurrent forms give the same logits.

Legend: B batch, T time, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments.training import schemas
from experiments.training.config_checks import check_sizes, model_config
from experiments.training.trainer import Task, Trainer
from linear_transformers.generation import generate, scan_steps
from linear_transformers.lm import CausalLM


def schema() -> ml_collections.ConfigDict:
    """Every key of a progressions config, with its default."""
    c = ml_collections.ConfigDict()
    c.task = "progressions"
    c.seed = 0
    c.vocab_size = 16
    c.seq_len = 24
    c.prompt_len = 3  # tokens given at evaluation; the model continues the rest
    c.model = schemas.model(
        attention="linear",
        num_layers=2,
        num_heads=4,
        model_dim=64,
        feed_forward_dim=128,
        dropout=0.0,
        dtype="float32",
    )
    schemas.optimisation(c)
    c.optimizer = "adamw"
    c.learning_rate = 3e-3
    c.weight_decay = 0.0
    c.grad_clip = 0.0
    c.batch_size = 32
    c.num_steps = 600
    schemas.bookkeeping(c)
    c.log_every = 100
    c.eval_every = 0  # at the end
    c.checkpoint_every = 0  # at the end
    c.eval_batch_size = 256
    schemas.devices(c)
    return c


def progressions(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    """[batch, length] int32 sequences a + t*d mod vocab with random start a and step d != 0."""
    a = rng.integers(0, vocab, (batch, 1))
    d = rng.integers(1, vocab, (batch, 1))
    return ((a + d * np.arange(length)[None, :]) % vocab).astype(np.int32)


def next_token_pairs(tokens_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets): every token but the last, and every token but the first (two arrays
    of one length, so both split alike over a sequence axis)."""
    return tokens_BT[:, :-1], tokens_BT[:, 1:]


def _next_token_loss(model, batch):
    inputs_BT, targets_BT = batch
    logits_BTV = model(inputs_BT)
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    )


class Progressions(Task):
    """Next-token prediction on arithmetic progressions; greedy continuation accuracy."""

    name = "progressions"
    schema = staticmethod(schema)

    def check(self) -> None:
        c = self.config
        check_sizes(c, positive=("eval_batch_size", "vocab_size", "seq_len", "prompt_len"))
        if not 1 <= c.prompt_len < c.seq_len:
            raise ValueError(f"config.prompt_len must be in [1, seq_len={c.seq_len}), got {c.prompt_len}.")
        if c.seq_len < 2:
            raise ValueError(f"config.seq_len must be >= 2 (an input and a target), got {c.seq_len}.")

    def sequence_length(self) -> int:
        return self.config.seq_len - 1  # the inputs: every token but the last

    def build_model(self, *, sequence_axis=None) -> CausalLM:
        c = self.config
        return CausalLM(
            model_config(c.model, sequence_axis=sequence_axis),
            c.vocab_size,
            rngs=nnx.Rngs(params=c.seed, dropout=c.seed + 1),
        )

    def batch(self, step: int):
        c = self.config
        rng = np.random.default_rng([c.seed, 0, step])
        tokens_BT = progressions(rng, c.batch_size, c.seq_len, c.vocab_size)
        return next_token_pairs(tokens_BT)

    def loss(self, model, batch):
        return _next_token_loss(model, batch), {}

    def eval_sums(self, model, batch) -> dict:
        return {"loss_sum": _next_token_loss(model, batch) * batch[0].shape[0]}

    def evaluate(self, trainer: Trainer) -> dict:
        """Held-out loss, greedy continuation accuracy after prompt_len tokens (recurrent
        form), and the largest |parallel - recurrent| logit difference at float32 products (it
        measures whether the two forms compute one function; a GPU's default TF32 products would
        add their rounding, ~1e-2 here)."""
        c = self.config
        test_BT = progressions(np.random.default_rng([c.seed, 1]), c.eval_batch_size, c.seq_len, c.vocab_size)
        eval_loss = trainer.eval_sums(next_token_pairs(test_BT))["loss_sum"] / len(test_BT)
        model = trainer.eval_model()
        generated_BT = generate(
            model,
            jnp.asarray(test_BT[:, : c.prompt_len]),
            c.seq_len - c.prompt_len,
            key=jax.random.key(c.seed),
            temperature=0.0,
        )
        accuracy = float(jnp.mean(generated_BT[:, c.prompt_len :] == test_BT[:, c.prompt_len :]))
        with jax.default_matmul_precision("highest"):
            parallel_BTV = model(jnp.asarray(test_BT))
            _, recurrent_BTV = scan_steps(
                model, model.init_state(test_BT.shape[0], max_length=test_BT.shape[1]), jnp.asarray(test_BT)
            )
        return {
            "eval_loss": eval_loss,
            "continuation_accuracy": accuracy,
            "parallel_vs_recurrent_max_abs_diff": float(jnp.max(jnp.abs(parallel_BTV - recurrent_BTV))),
        }
