"""The variable-length, packed copy task: what a step's packed batch holds (every example of
the step whole, segment ids, positions, loss mask), the packed loss against each example alone,
exact copies counted per segment, config checks, and end-to-end runs that resume exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import copy as copy_config
from experiments import tasks
from experiments.data import copy_task as ct
from experiments.tasks import copy as copy_task_lib


def _batches(config, seed=0, **overrides):
    """The task's own batches of `seed`, for `config` with `overrides`."""
    config = config.copy_and_resolve_references()
    config.update(overrides)
    return copy_task_lib.Copy(config).copy_batches(seed)


def _units(examples):
    """Each example's (inputs, targets, mask) as it would be alone: [0, s, 0, s] shifted."""
    units = []
    for s, n in zip(*examples):
        tokens = np.concatenate([[0], s[:n], [0], s[:n]])
        mask = np.zeros(2 * n + 1, np.float32)
        mask[n + 1 :] = 1
        units.append((tokens[:-1], tokens[1:], mask))
    return units


@pytest.mark.parametrize("size", ["smoke", "cpu"])
def test_a_packed_batch_holds_every_example_of_its_step_whole(size):
    config = copy_config.get_config(f"{size},variable_length")
    assert config.packed and config.min_symbols == 1
    batches = _batches(config)
    widths = []
    for step in range(3):
        examples = batches.examples(step)
        batch = batches.batch(step)
        assert isinstance(batch, ct.PackedBatch)
        T = config.max_length - 1
        assert all(x.shape == (config.batch_size, T) for x in batch)  # fixed: nothing recompiles
        # Most candidates fit (the variant aims at ~85% of the rows' tokens).
        assert config.examples_per_step - 3 <= len(examples.lengths_B) <= config.examples_per_step
        found = []
        for r in range(config.batch_size):
            ids = batch.segment_ids_BT[r]
            count = ids.max()
            filled = np.count_nonzero(ids)
            # Segments 1..count, contiguous and in order, then padding (id 0, mask 0, token 0).
            np.testing.assert_array_equal(
                ids[:filled], np.repeat(np.arange(1, count + 1), np.bincount(ids)[1:])
            )
            assert not ids[filled:].any() and not batch.mask_BT[r, filled:].any()
            assert not batch.inputs_BT[r, filled:].any() and not batch.positions_BT[r, filled:].any()
            for segment in range(1, count + 1):
                at = ids == segment
                np.testing.assert_array_equal(batch.positions_BT[r, at], np.arange(at.sum()))
                found.append(
                    tuple(tuple(x[r, at]) for x in (batch.inputs_BT, batch.targets_BT, batch.mask_BT))
                )
        expected = [tuple(tuple(x) for x in unit) for unit in _units(examples)]
        assert sorted(found) == sorted(expected)  # each example once, whole
        assert batch.mask_BT.sum() == examples.lengths_B.sum()  # loss on the copies only
        assert ct.real_tokens(batch) == np.sum(2 * examples.lengths_B + 1)
        widths.append(np.ptp(examples.lengths_B))
    assert max(widths) >= (config.max_length - 1) // 2 - 5  # lengths from a wide range


def test_padded_layout_holds_the_same_examples_one_per_row():
    config = copy_config.get_config("smoke,variable_length,packed=false")
    batches = _batches(config)
    examples = batches.examples(4)
    for a, b in zip(examples, _batches(config, packed=True).examples(4)):  # the packed layout's
        np.testing.assert_array_equal(a, b)
    batch = batches.batch(4)
    assert isinstance(batch, ct.LanguageModelBatch)
    assert batch.inputs_BT.shape == (config.examples_per_step, config.max_length - 1)
    kept = len(examples.lengths_B)
    np.testing.assert_array_equal(batch.mask_BT[:kept].sum(1), examples.lengths_B)
    assert not batch.mask_BT[kept:].any() and not batch.inputs_BT[kept:].any()  # did not fit: empty
    assert ct.real_tokens(batch) == ct.real_tokens(_batches(config, packed=True).batch(4))


def test_the_paper_layout_is_unchanged_by_the_new_keys():
    config = copy_config.get_config("smoke")
    assert (config.min_symbols, config.examples_per_step, config.packed) == (0, 0, False)
    rng = np.random.default_rng([0, 3])
    expected = ct.decoder_only_layout(ct.random_examples(rng, 32, 16, 4), 16)
    for x, y in zip(_batches(config).batch(3), expected):
        np.testing.assert_array_equal(x, y)


def test_batches_are_a_function_of_seed_and_step_whatever_was_drawn_before():
    config = copy_config.get_config("smoke,variable_length")
    fresh = _batches(config).batch(7)
    used = _batches(config)
    for step in (0, 9, 3):
        used.batch(step)
    for x, y in zip(used.batch(7), fresh):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(used.batch(8).inputs_BT, fresh.inputs_BT)
    assert not np.array_equal(_batches(config, seed=1).batch(7).inputs_BT, fresh.inputs_BT)


@pytest.mark.parametrize("kind", ["linear", "softmax", "retention", "simple-gla", "gla"])
def test_the_packed_loss_is_the_mean_of_the_examples_losses_alone(kind, float32_products):
    config = copy_config.get_config(
        f"smoke,variable_length,attention={kind},num_layers=1,model_dim=32,feed_forward_dim=64"
    )
    task = copy_task_lib.Copy(config)
    task.check()
    model = task.build_model()
    model.eval()
    loss_and_counts = nnx.jit(copy_task_lib.loss_and_counts)
    batches = _batches(config, seed=5)
    packed = batches.batch(0)
    loss, counts = loss_and_counts(model, packed)

    # Each example alone: a row of its own, nothing else in it (the padded layout), ...
    padded = _batches(config, seed=5, packed=False).batch(0)
    ce = np.asarray(_cross_entropy(model(padded.inputs_BT), padded.targets_BT))
    per_example_sum = (ce * padded.mask_BT).sum(1)
    n = padded.mask_BT.sum(1)
    np.testing.assert_allclose(float(loss), per_example_sum.sum() / n.sum(), rtol=1e-5, atol=1e-6)
    # ... and for a few examples, the exact length alone, no padding at all.
    for i, (inputs, targets, mask) in enumerate(_units(batches.examples(0))[:3]):
        ce_alone = _cross_entropy(model(jnp.asarray(inputs)[None])[0], targets)
        np.testing.assert_allclose(float(jnp.sum(ce_alone * mask)), per_example_sum[i], rtol=1e-5, atol=1e-6)
    # Counts per example: the packed ones equal the one-per-row ones.
    padded_loss, padded_counts = loss_and_counts(model, padded)
    np.testing.assert_allclose(float(padded_loss), float(loss), rtol=1e-5)
    assert {k: int(v) for k, v in counts.items()} == {k: int(v) for k, v in padded_counts.items()}
    assert int(counts["sequences"]) == len(batches.examples(0).lengths_B)
    # Time padded for a sequence-parallel mesh: padding is segment 0, mask 0; nothing changes.
    mesh_padded = task.pad_for_mesh(packed, 8)
    assert mesh_padded.segment_ids_BT.shape[1] % 8 == 0 and not mesh_padded.segment_ids_BT[:, -1].any()
    padded_time_loss, padded_time_counts = loss_and_counts(model, mesh_padded)
    np.testing.assert_allclose(float(padded_time_loss), float(loss), rtol=1e-5)
    assert {k: int(v) for k, v in padded_time_counts.items()} == {k: int(v) for k, v in counts.items()}


def _cross_entropy(logits_TV, targets_T):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_TV, -1), jnp.asarray(targets_T)[..., None], -1)[
        ..., 0
    ]


def test_exact_copies_are_counted_per_packed_segment():
    # Row 0: two examples, the second copied wrongly; row 1: one example, right; then padding.
    targets = jnp.array([[0, 1, 2, 0, 3, 4, 0], [5, 6, 0, 0, 0, 0, 0]])
    mask = jnp.array([[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]], jnp.float32)
    segments = jnp.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0, 0]])
    predicted = targets.at[0, 5].set(9).at[1, 4].set(7)  # 7 at padding: not counted
    counts = copy_task_lib.accuracy_counts(predicted, targets, mask, segments)
    assert {k: int(v) for k, v in counts.items()} == {"correct": 5, "symbols": 6, "exact": 2, "sequences": 3}
    # Per row it would be 1 of 2: the segment is the unit.
    per_row = copy_task_lib.accuracy_counts(predicted, targets, mask)
    assert (int(per_row["exact"]), int(per_row["sequences"])) == (1, 2)
    # An empty row (a padded layout's candidate that did not fit) is no sequence.
    empty = copy_task_lib.accuracy_counts(targets, targets, mask.at[1].set(0))
    assert (int(empty["exact"]), int(empty["sequences"])) == (1, 1)


@pytest.mark.parametrize(
    "arg,match",
    [
        (
            "encoder_decoder,smoke,packed=true",
            r"^config.packed=True and config.examples_per_step=0 apply to architecture='decoder' only",
        ),
        (
            "encoder_decoder,smoke,examples_per_step=40",
            r"config.examples_per_step=40 apply to architecture='decoder'",
        ),
        ("smoke,variable_length,lsh1", r"config.packed=True needs an attention kind that takes segment ids"),
        ("smoke,min_symbols=7", r"min_symbols=7 must be 0 \(max_length // 4\) or in \[1, 7\)"),
        ("smoke,min_symbols=-1", r"^config.min_symbols must be >= 0, got -1.$"),
    ],
)
def test_bad_variable_length_configs_fail_before_training(tmp_path, arg, match):
    with pytest.raises(ValueError, match=match):
        tasks.train_and_evaluate(copy_config.get_config(arg), tmp_path)


_TINY = "num_layers=1,model_dim=32,feed_forward_dim=64,eval_batches=1,checkpoint_every=0"


def test_the_trainer_runs_a_variable_length_config_and_resumes_exactly(tmp_path):
    config = copy_config.get_config(f"smoke,variable_length,num_steps=6,{_TINY}")
    losses = {}
    result = tasks.train_and_evaluate(
        config, tmp_path / "whole", step_callback=lambda s, m: losses.__setitem__(s, float(m["loss"]))
    )
    assert result["step"] == 6 and np.isfinite(result["eval_loss"])
    assert 0 <= result["sequence_accuracy"] <= 1 and 0 <= result["token_accuracy"] <= 1

    def stop_after_3(step, metrics):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tasks.train_and_evaluate(config, tmp_path / "resumed", step_callback=stop_after_3)
    resumed = {}
    again = tasks.train_and_evaluate(
        config, tmp_path / "resumed", step_callback=lambda s, m: resumed.__setitem__(s, float(m["loss"]))
    )
    assert sorted(resumed) == [4, 5, 6]  # the same batches, so the same losses
    assert [resumed[s] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]
    assert again["eval_loss"] == result["eval_loss"]


def test_the_trainer_runs_the_same_examples_padded(tmp_path):
    result = tasks.train_and_evaluate(
        copy_config.get_config(f"smoke,variable_length,packed=false,num_steps=2,{_TINY}"), tmp_path
    )
    assert result["step"] == 2 and np.isfinite(result["eval_loss"])


def test_the_comparison_counts_the_same_real_tokens_packed_and_padded():
    from experiments.benchmarking import copy_bench

    options = copy_bench.CopyComparisonOptions(
        runs=("decoder/varlen-packed", "decoder/varlen-padded"), size="cpu"
    )
    (packed, positions), (padded, padded_positions) = (
        copy_bench.real_tokens(copy_bench.run_config(name, options), 20) for name in options.runs
    )
    np.testing.assert_array_equal(packed, padded)  # the same examples
    assert positions == 32 * 63 and padded_positions == 53 * 63
    fill = copy_bench.throughput(
        [{"loss": 1, "step": 10, "wall_time": 2.0}, {"loss": 1, "step": 20, "wall_time": 3.0}],
        packed,
        positions,
    )
    assert fill["tokens_per_sec"] == packed[10:20].sum()
    assert 0.75 < fill["token_fill"] < 0.9 and 0.45 < packed.mean() / padded_positions < 0.55
