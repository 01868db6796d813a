"""`linear_transformers.ctc` against obviously correct references: the CTC loss as a sum over every
alignment (tiny T and C, float64), best-path decoding in plain Python, Levenshtein distance by
its recursive definition.

Legend: B batch, T time (frames), C classes (blank included), L label length, P alignments.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers.ctc import ctc_loss, edit_distance, error_counts, greedy_decode


def collapse(path, blank):
    """CTC's many-to-one map: merge runs of a class, then drop blanks."""
    return tuple(c for c, _ in itertools.groupby(path) if c != blank)


def brute_force_log_likelihood(logits_TC, frames, label, blank):
    """log p(label | first `frames` frames), summing over all C**frames alignments, in jnp (so it
    can be differentiated) at whatever precision the input has."""
    C = logits_TC.shape[1]
    log_probs_TC = jax.nn.log_softmax(logits_TC[:frames], axis=-1)
    paths_PT = [p for p in itertools.product(range(C), repeat=frames) if collapse(p, blank) == tuple(label)]
    if not paths_PT:
        return -jnp.inf
    paths_PT = np.asarray(paths_PT).reshape(len(paths_PT), frames)
    scores_P = jnp.sum(jnp.take_along_axis(log_probs_TC[None], paths_PT[..., None], axis=2)[..., 0], axis=1)
    return jax.scipy.special.logsumexp(scores_P)


def random_batch(rng, B, T, C, L, blank, *, garbage=True):
    """Logits, frame lengths in [1, T], labels of lengths in [0, L] (ids other than the blank),
    with the padding filled with garbage (including copies of the last label) unless told not."""
    logits_BTC = rng.normal(size=(B, T, C)) * 2
    frame_lengths_B = rng.integers(1, T + 1, size=B)
    label_lengths_B = rng.integers(0, L + 1, size=B)
    classes = [c for c in range(C) if c != blank]
    labels_BL = rng.choice(classes, size=(B, L))
    for b in range(B):
        if garbage:
            logits_BTC[b, frame_lengths_B[b] :] = rng.normal(size=(T - frame_lengths_B[b], C)) * 50
            fill = labels_BL[b, label_lengths_B[b] - 1] if label_lengths_B[b] else 0
            labels_BL[b, label_lengths_B[b] :] = rng.choice([fill, blank, 7])
    return logits_BTC, frame_lengths_B, labels_BL, label_lengths_B


@pytest.mark.parametrize("blank", [0, 2])
def test_loss_matches_the_sum_over_alignments(x64, blank):
    rng = np.random.default_rng(blank)
    B, T, C, L = 24, 5, 4, 3
    logits_BTC, frames_B, labels_BL, label_lengths_B = random_batch(rng, B, T, C, L, blank)
    loss_B = np.asarray(ctc_loss(jnp.asarray(logits_BTC), frames_B, labels_BL, label_lengths_B, blank=blank))
    assert loss_B.dtype == np.float32
    feasible = 0
    for b in range(B):
        expected = -float(
            brute_force_log_likelihood(
                jnp.asarray(logits_BTC[b]), frames_B[b], labels_BL[b, : label_lengths_B[b]], blank
            )
        )
        if np.isfinite(expected):
            feasible += 1
            np.testing.assert_allclose(loss_B[b], expected, rtol=1e-6, err_msg=f"row {b}")
        else:  # No alignment: optax's stand-in for log(0), finite and huge.
            assert np.isfinite(loss_B[b]) and loss_B[b] > 1e4, (b, loss_B[b])
    assert feasible >= B // 2  # the comparison above ran on real cases, not only infeasible ones


def test_loss_gradient_matches_the_sum_over_alignments(x64):
    rng = np.random.default_rng(1)
    B, T, C, L = 6, 5, 3, 2
    logits_BTC, _, labels_BL, label_lengths_B = random_batch(rng, B, T, C, L, 0, garbage=False)
    frames_B = rng.integers(2 * L, T + 1, size=B)  # room for any label of length L: all feasible
    frames_B[0], label_lengths_B[0] = T, L  # one row with no padding at all
    labels_BL[1], frames_B[1], label_lengths_B[1] = [1, 1], 4, 2  # a repeat (a blank between)
    real_BT1 = (np.arange(T) < frames_B[:, None])[..., None]
    logits_BTC = np.where(real_BT1, logits_BTC, rng.normal(size=logits_BTC.shape) * 50)

    def brute_force(logits_BTC):
        return -sum(
            brute_force_log_likelihood(logits_BTC[b], frames_B[b], labels_BL[b, : label_lengths_B[b]], 0)
            for b in range(B)
        )

    logits_BTC = jnp.asarray(logits_BTC)
    expected = jax.grad(brute_force)(logits_BTC)
    assert np.isfinite(brute_force(logits_BTC))
    got = jax.grad(lambda x: jnp.sum(ctc_loss(x, frames_B, labels_BL, label_lengths_B)))(logits_BTC)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    padded_BT = np.arange(T) >= frames_B[:, None]
    assert padded_BT.any() and np.all(np.asarray(got)[padded_BT] == 0)
    assert np.abs(np.asarray(got)[~padded_BT]).min() > 0  # the real frames do get a gradient


def test_loss_ignores_padding_and_runs_under_jit():
    rng = np.random.default_rng(2)
    B, T, C, L = 8, 6, 5, 3
    logits_BTC, frames_B, labels_BL, label_lengths_B = random_batch(rng, B, T, C, L, 0, garbage=False)
    real_BT1 = (np.arange(T) < frames_B[:, None])[..., None]
    real_BL = np.arange(L) < label_lengths_B[:, None]
    assert not real_BT1.all() and not real_BL.all()
    loss = jax.jit(ctc_loss)
    clean_B = loss(
        jnp.asarray(np.where(real_BT1, logits_BTC, 0.0), jnp.float32),
        frames_B,
        np.where(real_BL, labels_BL, 1),
        label_lengths_B,
    )
    dirty_B = loss(
        jnp.asarray(np.where(real_BT1, logits_BTC, rng.normal(size=logits_BTC.shape) * 1e3), jnp.float32),
        frames_B,
        np.where(real_BL, labels_BL, rng.integers(-5, 10, size=labels_BL.shape)),
        label_lengths_B,
    )
    np.testing.assert_allclose(dirty_B, clean_B, rtol=1e-6)


def test_loss_of_bfloat16_logits_is_float32():
    rng = np.random.default_rng(4)
    logits_BTC, frames_B, labels_BL, label_lengths_B = random_batch(rng, 4, 6, 5, 2, 0)
    bf16_BTC = jnp.asarray(logits_BTC, jnp.bfloat16)
    loss_B = ctc_loss(bf16_BTC, frames_B, labels_BL, label_lengths_B)
    assert loss_B.dtype == jnp.float32
    expected_B = ctc_loss(bf16_BTC.astype(jnp.float32), frames_B, labels_BL, label_lengths_B)
    np.testing.assert_allclose(loss_B, expected_B, rtol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(labels=np.zeros((2, 2), np.float32)), "labels must be integer"),
        (dict(labels=np.zeros((3, 2), np.int32)), r"labels must be \[batch=2, L\]"),
        (dict(logits=np.zeros((2, 4, 3), np.int32)), "logits must be floating"),
        (dict(logits=np.zeros((2, 4), np.float32)), r"logits must be \[batch, frames, classes\]"),
        (dict(frames=np.array([4.0, 3.0])), "frame_lengths must be an integer array"),
        (dict(frames=np.array([4, 3, 2])), r"frame_lengths must be an integer array of shape \(2,\)"),
        (dict(frames=np.array([5, 3])), r"frame_lengths must be in \[0, 4\].*\[5\]"),
        (dict(label_lengths=np.array([-1, 1])), r"label_lengths must be in \[0, 2\].*\[-1\]"),
        (dict(labels=np.array([[1, 0], [2, 1]])), r"other than the blank 0, got \[0\]"),
        (dict(labels=np.array([[1, 3], [2, 1]])), r"class ids in \[0, 3\).*got \[3\]"),
        (dict(blank=3), r"blank must be an int class id in \[0, 3\)"),
    ],
)
def test_loss_errors_name_the_bad_value(change, match):
    args = dict(
        logits=np.zeros((2, 4, 3), np.float32),
        frames=np.array([4, 3]),
        labels=np.array([[1, 2], [2, 1]]),
        label_lengths=np.array([2, 2]),
        blank=0,
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ctc_loss(args["logits"], args["frames"], args["labels"], args["label_lengths"], blank=args["blank"])


def python_greedy_decode(logits_TC, frames, blank):
    return list(collapse(np.argmax(logits_TC[:frames], axis=-1).tolist(), blank))


@pytest.mark.parametrize("blank", [0, 3])
def test_greedy_decode_matches_python(blank):
    rng = np.random.default_rng(5 + blank)
    B, T, C = 32, 9, 4
    # Few classes and long runs, so repeats, blank-separated repeats and empty rows all occur.
    logits_BTC = rng.normal(size=(B, T, C)).astype(np.float32)
    logits_BTC[:, 1::2] = logits_BTC[:, ::2][:, : T // 2]
    frames_B = rng.integers(0, T + 1, size=B)
    tokens_BT, lengths_B = jax.jit(functools.partial(greedy_decode, blank=blank))(logits_BTC, frames_B)
    assert tokens_BT.dtype == jnp.int32 and lengths_B.dtype == jnp.int32 and tokens_BT.shape == (B, T)
    for b in range(B):
        expected = python_greedy_decode(logits_BTC[b], frames_B[b], blank)
        assert lengths_B[b] == len(expected)
        assert tokens_BT[b].tolist() == expected + [-1] * (T - len(expected)), b


def test_greedy_decode_known_case():
    # Frame argmaxes: 1 1 0 1 2 2 0 | 2 (padding)  ->  1 1 2
    best_T = [1, 1, 0, 1, 2, 2, 0, 2]
    logits_1TC = jax.nn.one_hot(jnp.asarray([best_T]), 3)
    tokens_BT, lengths_B = greedy_decode(logits_1TC, jnp.asarray([7]))
    assert tokens_BT.tolist() == [[1, 1, 2, -1, -1, -1, -1, -1]] and lengths_B.tolist() == [3]


def test_greedy_decode_errors():
    with pytest.raises(ValueError, match=r"frame_lengths must be in \[0, 3\]"):
        greedy_decode(np.zeros((1, 3, 2), np.float32), np.array([4]))
    with pytest.raises(ValueError, match="frame_lengths must be an integer array"):
        greedy_decode(np.zeros((1, 3, 2), np.float32), np.array([3.0]))


@functools.lru_cache(maxsize=None)
def recursive_distance(a: tuple, b: tuple) -> int:
    """Levenshtein distance by its definition (memoised)."""
    if not a or not b:
        return len(a) + len(b)
    return min(
        recursive_distance(a[1:], b) + 1,
        recursive_distance(a, b[1:]) + 1,
        recursive_distance(a[1:], b[1:]) + (a[0] != b[0]),
    )


def test_edit_distance_known_cases():
    kitten, sitting = [10, 8, 19, 19, 4, 13], [18, 8, 19, 19, 8, 13, 6]
    assert edit_distance(kitten, sitting) == 3
    assert edit_distance([], [1, 2, 3]) == 3 and edit_distance([1, 2], []) == 2
    assert edit_distance([], []) == 0 and edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 2, 3], [3, 2, 1]) == 2
    assert edit_distance(np.array([1, 2, 3, 4]), np.array([2, 3, 4, 5])) == 2


def test_edit_distance_matches_the_recursive_definition():
    rng = np.random.default_rng(6)
    for _ in range(300):
        a = tuple(rng.integers(0, 3, size=rng.integers(0, 7)).tolist())
        b = tuple(rng.integers(0, 3, size=rng.integers(0, 7)).tolist())
        assert edit_distance(a, b) == recursive_distance(a, b), (a, b)
        assert edit_distance(b, a) == edit_distance(a, b)


def test_error_counts_sums_over_pairs():
    references = [[1, 2, 3], [4, 5], [], [6]]
    hypotheses = [[1, 3], [4, 5, 5], [7], [6]]
    assert error_counts(references, hypotheses) == (1 + 1 + 1 + 0, 6)
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        error_counts([[1], [2]], [[1]])
    with pytest.raises(ValueError, match="1-D sequence of ints"):
        edit_distance([[1, 2]], [1])
