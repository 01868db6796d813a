"""Acoustic models for CTC speech recognition: frames of features in, per-frame class logits out.

Legend: B batch, T time (frames), F features per frame, E model width, C classes (CTC outputs,
blank included), 2H the two directions' hidden states side by side.

  logits_BTC = model(features_BTF, frame_lengths_B=lengths_B)
  loss_B = ctc.ctc_loss(logits_BTC, lengths_B, labels_BL, label_lengths_B)

`FrameEncoder` is a non-causal transformer `Encoder` (any attention kind with a non-causal form:
"softmax", "linear", "reformer", "linformer", ...); `BiLSTMEncoder` is the paper's bi-LSTM
baseline, from Flax's own recurrent layers. In both, frames at index >= frame_lengths[b] are
padding: they are zeroed on the way in, and the logits of the real frames do not depend on them
(the padded frames' own logits are meaningless).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from linear_transformers.lm import sinusoidal_encoding
from linear_transformers.ops.input_checks import check_int, check_lengths
from linear_transformers.transformer import Encoder, TransformerConfig, dense


def _check_inputs(features_BTF, frame_lengths_B, input_dim: int, where: str):
    """Features as a float [B, T, input_dim] array with the padded frames zeroed, and the lengths
    as int32 [B], else a ValueError naming the bad argument. Zeroing keeps non-finite garbage in
    the padding (NaN * 0 is NaN) out of sums that mask it by a multiplication."""
    features_BTF = jnp.asarray(features_BTF)
    if features_BTF.ndim != 3 or features_BTF.shape[2] != input_dim:
        raise ValueError(
            f"{where}: features must be [batch, frames, input_dim={input_dim}], got shape "
            f"{tuple(features_BTF.shape)}."
        )
    if not jnp.issubdtype(features_BTF.dtype, jnp.floating):
        raise ValueError(
            f"{where}: features must be floating-point (float32, bfloat16, ...), got {features_BTF.dtype}."
        )
    B, T, _ = features_BTF.shape
    frame_lengths_B = check_lengths(frame_lengths_B, B, T, name="frame_lengths", what="frames", where=where)
    real_BT1 = (jnp.arange(T) < frame_lengths_B[:, None])[..., None]
    return jnp.where(real_BT1, features_BTF, jnp.zeros((), features_BTF.dtype)), frame_lengths_B


class FrameEncoder(nnx.Module):
    """Linear(F -> E) plus sinusoidal positions, dropout, a non-causal `Encoder`, Linear(E -> C).

    The positions are `lm.sinusoidal_encoding` ("concatenated" layout, [sin | cos]) *added* to the
    projected frames, as `CausalLM` adds them to token embeddings; so model_dim must be even.
    Dropout (config.dropout) applies to that sum, as in the original Transformer, and inside
    every layer. Computation is in config.dtype, parameters in config.param_dtype, and the logits
    in float32 at least (`config.output_dtype`; float32 when config.dtype is None and the
    inputs are float32 or narrower).

    The attention kind must have a non-causal form: "causal-linear" and the gated kinds
    ("retention", "simple-gla", "gla", which decay along time) refuse to be built here.
    """

    def __init__(self, config: TransformerConfig, *, input_dim: int, num_classes: int, rngs: nnx.Rngs):
        where = "FrameEncoder"
        self.input_dim = check_int(input_dim, f"{where}: input_dim")
        self.num_classes = check_int(num_classes, f"{where}: num_classes")
        if config.model_dim % 2:
            raise ValueError(
                f"{where}: config.model_dim must be even (sine/cosine pairs), got {config.model_dim}."
            )
        self.input_projection = dense(config, input_dim, config.model_dim, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.encoder = Encoder(config, causal=False, rngs=rngs)
        self.head = dense(config, config.model_dim, num_classes, rngs, dtype=config.output_dtype)

    def __call__(self, features_BTF, *, frame_lengths_B):
        """Logits [B, T, C]; frames at index >= frame_lengths_B[b] are padding (masked as keys)."""
        features_BTF, frame_lengths_B = _check_inputs(
            features_BTF, frame_lengths_B, self.input_dim, "FrameEncoder"
        )
        x_BTE = self.input_projection(features_BTF)
        x_BTE = x_BTE + sinusoidal_encoding(jnp.arange(x_BTE.shape[1]), x_BTE.shape[-1], x_BTE.dtype)
        y_BTE = self.encoder(self.dropout(x_BTE), key_lengths=frame_lengths_B)
        logits_BTC = self.head(y_BTE)
        return logits_BTC.astype(jnp.promote_types(logits_BTC.dtype, jnp.float32))


class BiLSTMEncoder(nnx.Module):
    """num_layers bidirectional LSTM layers (`nnx.Bidirectional` of two `nnx.RNN`s over
    `nnx.OptimizedLSTMCell`s), forward and backward states concatenated, Linear(2H -> C).

    `seq_lengths` makes each backward LSTM start at its row's last real frame (Flax flips only
    the first frame_lengths[b] frames), so no direction reads padding before a real frame.
    Dropout (`dropout`) applies between layers, as torch.nn.LSTM's does, not after the last.
    Parameters and computation are float32 (bfloat16 features are promoted).
    """

    def __init__(
        self,
        *,
        input_dim: int,
        hidden_size: int,
        num_layers: int,
        num_classes: int,
        dropout: float = 0.0,
        rngs: nnx.Rngs,
    ):
        where = "BiLSTMEncoder"
        self.input_dim = check_int(input_dim, f"{where}: input_dim")
        self.num_classes = check_int(num_classes, f"{where}: num_classes")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}.")

        hidden_size = check_int(hidden_size, f"{where}: hidden_size")
        check_int(num_layers, f"{where}: num_layers")

        def lstm(in_features):
            return nnx.RNN(nnx.OptimizedLSTMCell(in_features, hidden_size, rngs=rngs))

        self.layers = nnx.List(
            [
                nnx.Bidirectional(lstm(width), lstm(width))
                for width in [input_dim] + [2 * hidden_size] * (num_layers - 1)
            ]
        )
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(2 * hidden_size, num_classes, rngs=rngs)

    def __call__(self, features_BTF, *, frame_lengths_B):
        """Logits [B, T, C] (float32); frames at index >= frame_lengths_B[b] are padding."""
        features_BTF, frame_lengths_B = _check_inputs(
            features_BTF, frame_lengths_B, self.input_dim, "BiLSTMEncoder"
        )
        x_BTF = features_BTF.astype(jnp.promote_types(features_BTF.dtype, jnp.float32))
        for i, layer in enumerate(self.layers):
            if i:
                x_BTF = self.dropout(x_BTF)
            x_BTF = layer(x_BTF, seq_lengths=frame_lengths_B)  # [B, T, 2H]
        return self.head(x_BTF)
