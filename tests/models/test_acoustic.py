"""`FrameEncoder` and `BiLSTMEncoder`: shapes and dtypes, padding invariance (the logits of real
frames ignore whatever lies past frame_lengths), the bi-LSTM's backward direction, finite
gradients, and overfitting one batch with the CTC loss.

Legend: B batch, T time (frames), F features per frame, C classes (blank included), L label length.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from linear_transformers.acoustic import BiLSTMEncoder, FrameEncoder
from linear_transformers.ctc import ctc_loss, greedy_decode
from linear_transformers.transformer import TransformerConfig

# float32 agreement between forms, with float32 matrix products on every platform (on an H200
# the bi-LSTM's directions parted by 8e-5 at its default TF32 products).
pytestmark = pytest.mark.usefixtures("float32_products")

F, C = 6, 5


def config(attention="linear", **kwargs):
    fields = dict(
        num_layers=2, num_heads=2, model_dim=16, feed_forward_dim=32, dropout=0.0, attention=attention
    )
    return TransformerConfig(**(fields | kwargs))


# Reformer: chunks of 4 over 9..16 frames, so queries see a window of the hash-sorted order and
# the padding, in a bucket of its own, falls into chunks past the real frames.
ENCODERS = {
    "softmax": lambda: FrameEncoder(config("softmax"), input_dim=F, num_classes=C, rngs=nnx.Rngs(0)),
    "linear": lambda: FrameEncoder(config("linear"), input_dim=F, num_classes=C, rngs=nnx.Rngs(1)),
    "reformer": lambda: FrameEncoder(
        config("reformer", attention_options=dict(chunk_size=4, num_buckets=4, num_rounds=2)),
        input_dim=F,
        num_classes=C,
        rngs=nnx.Rngs(2),
    ),
    "linformer": lambda: FrameEncoder(
        config("linformer", attention_options=dict(max_length=16, projected_length=4)),
        input_dim=F,
        num_classes=C,
        rngs=nnx.Rngs(3),
    ),
    "bilstm": lambda: BiLSTMEncoder(
        input_dim=F, hidden_size=8, num_layers=2, num_classes=C, rngs=nnx.Rngs(4)
    ),
}


@nnx.jit
def run(model, features_BTF, frame_lengths_B):
    return model(features_BTF, frame_lengths_B=frame_lengths_B)


def features(seed, shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_padding_does_not_reach_real_frames(name):
    model = ENCODERS[name]()
    model.eval()
    B, T, extra = 3, 9, 7
    lengths_B = np.array([9, 5, 1])
    x_BTF = features(0, (B, T, F))
    logits_BTC = np.asarray(run(model, x_BTF, lengths_B))
    assert logits_BTC.shape == (B, T, C) and logits_BTC.dtype == np.float32
    assert np.all(np.isfinite(logits_BTC))

    # Garbage past each row's length, and more frames of it (NaN included) appended.
    garbage_BTF = features(1, (B, T + extra, F)) * 30
    garbage_BTF[1, 7, 2] = np.nan
    real_BT1 = (np.arange(T + extra) < lengths_B[:, None])[..., None]
    padded_BTF = np.where(real_BT1, np.pad(x_BTF, ((0, 0), (0, extra), (0, 0))), garbage_BTF)
    padded_BTC = np.asarray(run(model, padded_BTF, lengths_B))
    assert padded_BTC.shape == (B, T + extra, C)
    for b, length in enumerate(lengths_B):
        np.testing.assert_allclose(padded_BTC[b, :length], logits_BTC[b, :length], atol=2e-5, rtol=1e-5)

    # Not vacuous: with the padding declared real, the same garbage does move the real frames.
    unmasked_BTC = np.asarray(run(model, np.nan_to_num(padded_BTF), np.full(B, T + extra)))
    assert np.abs(unmasked_BTC[1, :5] - logits_BTC[1, :5]).max() > 1e-3

    # Non-causal: a later real frame changes an earlier frame's logits.
    later_BTF = x_BTF.copy()
    later_BTF[0, 7] += 1.0
    assert np.abs(np.asarray(run(model, later_BTF, lengths_B))[0, 1] - logits_BTC[0, 1]).max() > 1e-4


def test_bilstm_backward_direction_starts_at_the_last_real_frame():
    model = ENCODERS["bilstm"]()
    B, T = 2, 8
    lengths_B = np.array([8, 5])
    x_BTF = features(2, (B, T, F))
    logits_BTC = np.asarray(run(model, x_BTF, lengths_B))
    changed_BTF = x_BTF.copy()
    changed_BTF[:, lengths_B[1] - 1] += 1.0  # the last real frame of row 1, a middle one of row 0
    changed_BTC = np.asarray(run(model, changed_BTF, lengths_B))
    # The future reaches the past (through the backward LSTM) in both rows...
    assert np.abs(changed_BTC[:, 0] - logits_BTC[:, 0]).min() > 1e-5
    # ...and row 1's backward LSTM starts at its last real frame: the row cut to its length (no
    # padding to read) gives the same logits.
    cut_BTC = np.asarray(run(model, x_BTF[1:, :5], lengths_B[1:]))
    np.testing.assert_allclose(logits_BTC[1, :5], cut_BTC[0], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_frame_encoder_dtypes(dtype):
    model = FrameEncoder(config("softmax", dtype=dtype), input_dim=F, num_classes=C, rngs=nnx.Rngs(0))
    logits_BTC = model(jnp.asarray(features(3, (2, 4, F)), dtype), frame_lengths_B=np.array([4, 2]))
    assert logits_BTC.shape == (2, 4, C) and logits_BTC.dtype == jnp.float32
    params = nnx.state(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert np.all(np.isfinite(np.asarray(logits_BTC)))


@pytest.mark.parametrize("kind", ["gla", "retention", "causal-linear"])
def test_causal_only_kinds_are_refused(kind):
    with pytest.raises(ValueError, match="causal by definition"):
        FrameEncoder(config(kind), input_dim=F, num_classes=C, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["linear", "bilstm"])
def test_bad_inputs_raise_clear_errors(name):
    model = ENCODERS[name]()
    x_BTF, lengths_B = features(0, (2, 4, F)), np.array([4, 3])
    with pytest.raises(
        ValueError, match=r"features must be \[batch, frames, input_dim=6\], got shape \(2, 4, 5\)"
    ):
        model(x_BTF[..., :5], frame_lengths_B=lengths_B)
    with pytest.raises(
        ValueError, match=r"features must be \[batch, frames, input_dim=6\], got shape \(4, 6\)"
    ):
        model(x_BTF[0], frame_lengths_B=lengths_B)
    with pytest.raises(ValueError, match="features must be floating-point"):
        model(x_BTF.astype(np.int32), frame_lengths_B=lengths_B)
    with pytest.raises(ValueError, match=r"frame_lengths must be an integer array of shape \(2,\)"):
        model(x_BTF, frame_lengths_B=lengths_B.astype(np.float32))
    with pytest.raises(ValueError, match=r"frame_lengths must be in \[0, 4\].*\[5\]"):
        model(x_BTF, frame_lengths_B=np.array([5, 3]))


def test_bad_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match="model_dim must be even"):
        FrameEncoder(config(model_dim=15, num_heads=3), input_dim=F, num_classes=C, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="FrameEncoder: input_dim must be an integer >= 1, got 0"):
        FrameEncoder(config(), input_dim=0, num_classes=C, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="BiLSTMEncoder: num_layers must be an integer >= 1"):
        BiLSTMEncoder(input_dim=F, hidden_size=8, num_layers=0, num_classes=C, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"BiLSTMEncoder: dropout must be in \[0, 1\)"):
        BiLSTMEncoder(input_dim=F, hidden_size=8, num_layers=1, num_classes=C, dropout=1.0, rngs=nnx.Rngs(0))


def overfitting_batch():
    """Two utterances whose frames encode their labels (a few frames per label, then noise), so a
    tiny model can learn them; row 1 is padded."""
    rng = np.random.default_rng(7)
    B, T = 2, 14
    labels_BL = np.array([[1, 2, 2, 3], [4, 1, 3, 0]])
    label_lengths_B = np.array([4, 3])
    frame_lengths_B = np.array([14, 10])
    codes_CF = rng.normal(size=(C, F))
    x_BTF = rng.normal(size=(B, T, F)) * 0.1
    for b in range(B):
        for n, label in enumerate(labels_BL[b, : label_lengths_B[b]]):
            x_BTF[b, 3 * n + 1 : 3 * n + 3] += codes_CF[label]
    return x_BTF.astype(np.float32), frame_lengths_B, labels_BL, label_lengths_B


@pytest.mark.parametrize("name", ["linear", "bilstm"])
def test_overfits_one_batch_and_decodes_its_labels(name):
    model = ENCODERS[name]()
    x_BTF, frame_lengths_B, labels_BL, label_lengths_B = overfitting_batch()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(model):
        logits_BTC = model(x_BTF, frame_lengths_B=frame_lengths_B)
        return jnp.mean(ctc_loss(logits_BTC, frame_lengths_B, labels_BL, label_lengths_B))

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, grads

    first, grads = train_step(model, optimizer)
    chex.assert_tree_all_finite(grads)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 0
    for _ in range(60):
        last, _ = train_step(model, optimizer)
    model.eval()
    last = float(nnx.jit(loss_fn)(model))
    assert np.isfinite(last) and last < 0.1 * float(first), (float(first), last)
    tokens_BT, lengths_B = greedy_decode(run(model, x_BTF, frame_lengths_B), frame_lengths_B)
    for b in range(2):
        assert tokens_BT[b, : lengths_B[b]].tolist() == labels_BL[b, : label_lengths_B[b]].tolist()
