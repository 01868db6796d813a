"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): a sequence states n
key-value pairs, then asks for each key again; the model must answer with its value. It
measures what a fixed-size state can recall: additive linear attention blurs as n grows, the
delta rule overwrites (`Mqar`).

  k_1 v_1 k_2 v_2 ... k_n v_n  0 0 k_3 0 k_1 0 0 k_n ...
                                   ^v_3  ^v_1     ^v_n    (the targets: the value after a query)

Keys are drawn without replacement from [1, V/2), values from [V/2, V) (V = vocab_size); the
n queries (every key once, in random order) sit at random distinct positions after the pairs,
the other positions hold 0. The loss and the accuracy count the query positions only.

Legend: B batch, T time, V vocabulary.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments.training import schemas
from experiments.training.config_checks import check_sizes, model_config
from experiments.training.trainer import Task, Trainer
from linear_transformers.lm import CausalLM


def schema() -> ml_collections.ConfigDict:
    """Every key of an MQAR config, with its default (CPU-sized: 2 layers of width 64)."""
    c = ml_collections.ConfigDict()
    c.task = "mqar"
    c.seed = 0
    c.vocab_size = 256
    c.seq_len = 128
    c.num_kv_pairs = 16
    c.model = schemas.model(
        attention="linear",
        num_layers=2,
        num_heads=2,
        model_dim=64,
        feed_forward_dim=128,
        dropout=0.0,
        dtype="float32",
    )
    schemas.optimisation(c)
    c.optimizer = "adamw"
    c.learning_rate = 3e-3
    c.weight_decay = 0.1
    c.batch_size = 64
    c.num_steps = 3000
    schemas.bookkeeping(c)
    c.log_every = 100
    c.eval_every = 0  # at the end
    c.checkpoint_every = 0  # at the end
    c.eval_batch_size = 512
    schemas.devices(c)
    return c


def mqar_batch(rng: np.random.Generator, batch: int, length: int, pairs: int, vocab: int):
    """(inputs, targets) int32 [batch, length]: the sequences of the module docstring, and each
    query's value at its position (-1 elsewhere: not scored)."""
    half = vocab // 2
    keys = np.stack([rng.choice(np.arange(1, half), pairs, replace=False) for _ in range(batch)])
    values = rng.integers(half, vocab, (batch, pairs))
    inputs = np.zeros((batch, length), np.int64)
    inputs[:, 0 : 2 * pairs : 2], inputs[:, 1 : 2 * pairs : 2] = keys, values
    targets = np.full((batch, length), -1, np.int64)
    rows = np.arange(batch)[:, None]
    positions = np.sort(
        np.stack([rng.choice(length - 2 * pairs, pairs, replace=False) for _ in range(batch)])
    )
    positions = positions + 2 * pairs
    order = np.stack([rng.permutation(pairs) for _ in range(batch)])
    inputs[rows, positions] = keys[rows, order]
    targets[rows, positions] = values[rows, order]
    return inputs.astype(np.int32), targets.astype(np.int32)


def _scored(model, batch):
    """(summed cross-entropy, correct answers, queries) over the query positions."""
    inputs_BT, targets_BT = batch
    logits_BTV = model(inputs_BT).astype(jnp.float32)
    query_BT = targets_BT >= 0
    labels_BT = jnp.where(query_BT, targets_BT, 0)
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == labels_BT) & query_BT
    return jnp.sum(jnp.where(query_BT, losses_BT, 0)), jnp.sum(correct_BT), jnp.sum(query_BT)


class Mqar(Task):
    """Next-value prediction at the queries; recall accuracy on held-out sequences."""

    name = "mqar"
    schema = staticmethod(schema)

    def check(self) -> None:
        c = self.config
        check_sizes(c, positive=("eval_batch_size", "vocab_size", "seq_len", "num_kv_pairs"))
        if c.num_kv_pairs > c.vocab_size // 2 - 1:
            raise ValueError(
                f"config.num_kv_pairs={c.num_kv_pairs} needs as many distinct keys in [1, vocab_size / 2) "
                f"= [1, {c.vocab_size // 2}): at most {c.vocab_size // 2 - 1}."
            )
        if 3 * c.num_kv_pairs > c.seq_len:
            raise ValueError(
                f"config.seq_len={c.seq_len} must hold the {c.num_kv_pairs} pairs and a query for each "
                f"key: at least 3 * num_kv_pairs = {3 * c.num_kv_pairs}."
            )

    def sequence_length(self) -> int:
        return self.config.seq_len

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
        return mqar_batch(rng, c.batch_size, c.seq_len, c.num_kv_pairs, c.vocab_size)

    def loss(self, model, batch):
        loss_sum, correct, queries = _scored(model, batch)
        return loss_sum / queries, {"correct": correct, "queries": queries}

    def train_scalars(self, loss, sums) -> dict:
        return {"train_recall_accuracy": sums["correct"] / sums["queries"]}

    def progress(self, scalars) -> dict:
        return {"loss": f"{scalars['loss']:.4f}", "recall": f"{scalars['train_recall_accuracy']:.3f}"}

    def eval_sums(self, model, batch) -> dict:
        loss_sum, correct, queries = _scored(model, batch)
        return {"loss_sum": loss_sum, "correct": correct, "queries": queries}

    def evaluate(self, trainer: Trainer) -> dict:
        """Held-out loss per query and recall accuracy (the share of queries answered with
        their value), on eval_batch_size sequences no training batch holds."""
        c = self.config
        test = mqar_batch(
            np.random.default_rng([c.seed, 1]), c.eval_batch_size, c.seq_len, c.num_kv_pairs, c.vocab_size
        )
        sums = trainer.eval_sums(test)
        return {
            "eval_loss": float(sums["loss_sum"] / sums["queries"]),
            "recall_accuracy": float(sums["correct"] / sums["queries"]),
        }
