"""Weights of the authors' PyTorch models (pytorch-fast-transformers) in our Flax modules.

    state_dict = load_torch_checkpoint("model.pth")      # or {name: numpy array}
    config = config_from_builder_kwargs(**the_builder_kwargs)
    encoder = encoder_from_fast_transformers(state_dict, config, causal=True)
    decoder = decoder_from_fast_transformers(state_dict, config)
    model = image_generator_from_fast_transformers(state_dict, config)   # the colab's Generator

Names map one to one (a torch Linear's weight [out, in] is our kernel [in, out]; layer i is
index i of our stacked layers, `layer_stack`):

    layers.{i}.attention.{query,key,value,out}_projection   layers.attention.{query,key,value,out}
    layers.{i}.self_attention.* / cross_attention.*         layers.self_attention / cross_attention
    layers.{i}.linear1, linear2                             layers.feed_forward.linear1, linear2
    layers.{i}.norm1, norm2 (, norm3 in decoders)           the residuals' norms, in order
    norm                                                    final_norm

The same state dict serves the parallel (`TransformerEncoder`) and recurrent
(`RecurrentEncoder`) forms: ours run either way from one set of parameters. Converted modules
are returned in eval mode (dropout off; `.train()` to fine-tune). A missing or unexpected key, or
a shape that does not fit the config, is an error naming it.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_transformers import _deprecation
from linear_transformers.image_generator import ImageGenerator
from linear_transformers.interop.builder_arguments import builder_fields
from linear_transformers.lm import sinusoidal_encoding
from linear_transformers.transformer import Decoder, Encoder, TransformerConfig

_CONVERTIBLE_KINDS = ("softmax", "linear", "causal-linear")


def config_from_builder_kwargs(**kwargs) -> TransformerConfig:
    """The `TransformerConfig` of the model the authors' builders (`TransformerEncoderBuilder`,
    `RecurrentEncoderBuilder`, `TransformerDecoderBuilder`, `RecurrentDecoderBuilder`) build
    from the same keyword arguments, with their defaults; `interop.builder_arguments` says how
    each argument maps.

    >>> config_from_builder_kwargs(n_layers=8, n_heads=8, query_dimensions=32,
    ...                            value_dimensions=32, attention_type="causal-linear")
    """
    return TransformerConfig(**builder_fields(**kwargs))


def _deprecated_from_kwargs(cls, **kwargs) -> TransformerConfig:
    """Deprecated: `interop.config_from_builder_kwargs(**kwargs)`, the same config."""
    _deprecation.warn(
        "TransformerConfig.from_kwargs", "linear_transformers.interop.config_from_builder_kwargs"
    )
    return cls(**builder_fields(**kwargs))


# The second door to the builders' arguments, kept open for the code that uses it: set here, where
# they are read, so that TransformerConfig (plain data, below this module) knows nothing of them.
TransformerConfig.from_kwargs = classmethod(_deprecated_from_kwargs)


def load_torch_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A PyTorch `state_dict` file (`torch.save(model.state_dict(), path)`) as numpy arrays.

    Needs PyTorch (`pip install "linear-transformers[torch]"`); tensors are read on the CPU with
    `weights_only=True` (no code in the file is run). A checkpoint dict holding the state dict
    under "state_dict" or "model" is accepted too.
    """
    try:
        import torch
    except ImportError:
        raise ImportError(
            "load_torch_checkpoint reads .pth files with PyTorch, which is not installed; "
            'install it with `pip install "linear-transformers[torch]"` (or `pip install '
            "torch`), or pass the state dict as a mapping of names to numpy arrays."
        ) from None
    loaded = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    if isinstance(loaded, Mapping) and not _is_state_dict(loaded):
        for key in ("state_dict", "model"):
            if _is_state_dict(loaded.get(key)):
                loaded = loaded[key]
                break
    if not _is_state_dict(loaded):
        raise ValueError(
            f"load_torch_checkpoint: {os.fspath(path)!r} holds no state dict (a "
            f"mapping of names to tensors); found {type(loaded).__name__}"
            + (f" with keys {sorted(loaded)[:8]}" if isinstance(loaded, Mapping) else "")
            + "."
        )
    return as_numpy_state_dict(loaded)


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A state dict from `path`: a `.npz` archive of {name: array} (no PyTorch needed; write one
    with `np.savez(path, **as_numpy_state_dict(state_dict))`), else a PyTorch file read by
    `load_torch_checkpoint`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no state dict file at {path!r}.")
    if path.endswith(".npz"):
        return _load_npz(path)
    return load_torch_checkpoint(path)


def _load_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of the archive at `path`, or one ValueError naming the file: numpy's own
    errors for a damaged file are several frames deep, and for one that is not a zip archive
    they advise allow_pickle, which would run code from the file."""
    what = f"{path!r} is not a readable .npz state dict (a zip archive of arrays, np.savez)"
    if not zipfile.is_zipfile(path):
        size = os.path.getsize(path)
        raise ValueError(f"{what}: it is not a zip archive ({size} bytes; truncated or another format).")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as e:
        if "pickle" in str(e):
            raise ValueError(
                f"{what}: an array in it holds Python objects, which are not unpickled (that could "
                f"run code from the file); save plain numeric arrays."
            ) from None
        raise ValueError(f"{what}: it is damaged or truncated ({type(e).__name__}: {e}).") from None


def _is_state_dict(value) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(hasattr(v, "shape") for v in value.values())


def as_numpy_state_dict(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{name: numpy array} from numpy arrays or torch tensors (read on the CPU)."""

    def to_numpy(value):
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16: widen, exactly
                value = value.float()
            value = value.numpy()
        return np.asarray(value)

    return {str(k): to_numpy(v) for k, v in state_dict.items()}


class _Loader:
    """Assigns state-dict entries to parameters, checking shapes, and reports leftovers.
    `layer` set: the parameters are a stack's ([L, ...], `layer_stack`), and the entries go to
    index `layer` of them."""

    def __init__(self, state_dict: Mapping[str, Any], what: str):
        self.arrays = as_numpy_state_dict(state_dict)
        self.unused = set(self.arrays)
        self.what = what
        self.layer = None

    def take(self, key: str, param: nnx.Param, *, transpose: bool = False):
        value = param.get_value()
        shape = tuple(value.shape if self.layer is None else value.shape[1:])
        expected = shape[::-1] if transpose else shape
        if key not in self.arrays:
            raise ValueError(f"{self.what}: the state dict has no {key!r} (expected shape {expected}).")
        array = self.arrays[key]
        if tuple(array.shape) != expected:
            raise ValueError(
                f"{self.what}: {key!r} has shape {tuple(array.shape)}; this config expects {expected}."
            )
        # An integer array would be cast silently, a NaN would reach every output.
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(
                f"{self.what}: {key!r} holds {array.dtype} values; weights must be floating point "
                f"(float32, bfloat16, float16 or float64), not cast from another type."
            )
        bad = ~np.isfinite(array.astype(np.float32))
        if bad.any():
            raise ValueError(
                f"{self.what}: {key!r} is not finite: {int(bad.sum())} of {array.size} values are NaN "
                f"or inf, so the model would be too."
            )
        self.unused.discard(key)
        array = jnp.asarray(array.T if transpose else array, value.dtype)
        param.set_value(array if self.layer is None else value.at[self.layer].set(array))

    def linear(self, key: str, linear: nnx.Linear):
        self.take(f"{key}.weight", linear.kernel, transpose=True)
        self.take(f"{key}.bias", linear.bias)

    def norm(self, key: str, norm: nnx.LayerNorm):
        self.take(f"{key}.weight", norm.scale)
        self.take(f"{key}.bias", norm.bias)

    def attention(self, key: str, attention):
        for name in ("query", "key", "value", "out"):
            self.linear(f"{key}.{name}_projection", getattr(attention, name))

    def finish(self, ignore: tuple[str, ...] = ()):
        unused = sorted(k for k in self.unused if k not in ignore)
        if unused:
            raise ValueError(
                f"{self.what}: unexpected keys in the state dict: {unused[:10]}"
                + (f" and {len(unused) - 10} more" if len(unused) > 10 else "")
                + "; is the config the one the model was built with?"
            )


def _check_config(config: TransformerConfig, where: str):
    if not isinstance(config, TransformerConfig):
        raise ValueError(
            f"{where}: config must be a TransformerConfig (e.g. "
            f"interop.config_from_builder_kwargs(**builder_kwargs)), got "
            f"{type(config).__name__}."
        )
    for kind in dict.fromkeys((config.attention, config.cross_kind)):
        if kind not in _CONVERTIBLE_KINDS:
            raise ValueError(
                f"{where}: attention kind {kind!r} cannot be converted; "
                f"convertible: {list(_CONVERTIBLE_KINDS)}."
            )
    for options in (config.attention_options, config.cross_options):
        if options.get("feature_map", "elu") != "elu":
            raise ValueError(
                f"{where}: only the authors' default feature map (elu(x) + 1) "
                f"converts; got feature_map={options['feature_map']!r}."
            )


def _layer_count(arrays: Mapping[str, Any], prefix: str) -> int:
    indices = {
        int(k[len(prefix) :].split(".")[0])
        for k in arrays
        if k.startswith(prefix) and k[len(prefix) :].split(".")[0].isdigit()
    }
    return max(indices) + 1 if indices else 0


def _check_layer_count(loader: _Loader, prefix: str, config: TransformerConfig):
    found = _layer_count(loader.arrays, f"{prefix}layers.")
    if found != config.num_layers:
        raise ValueError(
            f"{loader.what}: the state dict has {found} layers under "
            f"{prefix + 'layers.'!r}; the config has num_layers={config.num_layers}."
        )


def _load_encoder(loader: _Loader, encoder: Encoder, prefix: str, config: TransformerConfig):
    _check_layer_count(loader, prefix, config)
    layer = encoder.layers
    for i in range(config.num_layers):
        key, loader.layer = f"{prefix}layers.{i}", i
        loader.attention(f"{key}.attention", layer.attention)
        loader.linear(f"{key}.linear1", layer.feed_forward.linear1)
        loader.linear(f"{key}.linear2", layer.feed_forward.linear2)
        loader.norm(f"{key}.norm1", layer.attention_residual.norm)
        loader.norm(f"{key}.norm2", layer.feed_forward_residual.norm)
    loader.layer = None
    if encoder.final_norm is not None:
        loader.norm(f"{prefix}norm", encoder.final_norm)


def encoder_from_fast_transformers(
    state_dict: Mapping[str, Any], config: TransformerConfig, *, causal: bool = False, prefix: str = ""
) -> Encoder:
    """Our `Encoder` with the weights of their `TransformerEncoder` or `RecurrentEncoder`.

    causal=True for a model used with a `TriangularCausalMask` or built by
    `RecurrentEncoderBuilder` (it then has `step` / `prefill`). `prefix`: the encoder's key
    prefix in a larger model's state dict (e.g. "transformer."); keys outside it are ignored.
    """
    _check_config(config, "encoder_from_fast_transformers")
    encoder = Encoder(config, causal=causal, rngs=nnx.Rngs(0))
    loader = _Loader(state_dict, "encoder_from_fast_transformers")
    _load_encoder(loader, encoder, prefix, config)
    loader.finish(ignore=tuple(k for k in loader.arrays if not k.startswith(prefix)))
    encoder.eval()
    return encoder


def decoder_from_fast_transformers(
    state_dict: Mapping[str, Any], config: TransformerConfig, *, prefix: str = ""
) -> Decoder:
    """Our `Decoder` with the weights of their `TransformerDecoder` or `RecurrentDecoder`
    (causal self-attention, cross-attention to a memory). `prefix` as in
    `encoder_from_fast_transformers`."""
    _check_config(config, "decoder_from_fast_transformers")
    decoder = Decoder(config, rngs=nnx.Rngs(0))
    loader = _Loader(state_dict, "decoder_from_fast_transformers")
    _check_layer_count(loader, prefix, config)
    layer = decoder.layers
    for i in range(config.num_layers):
        key, loader.layer = f"{prefix}layers.{i}", i
        loader.attention(f"{key}.self_attention", layer.self_attention)
        loader.attention(f"{key}.cross_attention", layer.cross_attention)
        loader.linear(f"{key}.linear1", layer.feed_forward.linear1)
        loader.linear(f"{key}.linear2", layer.feed_forward.linear2)
        loader.norm(f"{key}.norm1", layer.self_attention_residual.norm)
        loader.norm(f"{key}.norm2", layer.cross_attention_residual.norm)
        loader.norm(f"{key}.norm3", layer.feed_forward_residual.norm)
    loader.layer = None
    if decoder.final_norm is not None:
        loader.norm(f"{prefix}norm", decoder.final_norm)
    loader.finish(ignore=tuple(k for k in loader.arrays if not k.startswith(prefix)))
    decoder.eval()
    return decoder


def generator_config(
    state_dict: Mapping[str, Any], *, attention_type: str, n_heads: int, **builder_kwargs
) -> TransformerConfig:
    """The config of the colab's `Generator` / `RecurrentGenerator` whose weights these are.

    Depth, width, query and feed-forward dimensions are read from the shapes; the attention
    type ("linear" or "full": a state dict does not say) and the number of heads are not in
    the weights and must be given. Further builder arguments (dropout, softmax_temp, ...)
    default to the colab's: dropout 0.1, attention_dropout 0.1.
    """
    arrays = as_numpy_state_dict(state_dict)
    key = "transformer.layers.0.attention.query_projection.weight"
    if key not in arrays:
        raise ValueError(
            f"generator_config: the state dict has no {key!r}; expected the colab's "
            "Generator / RecurrentGenerator (transformer.layers.*, value_embedding, "
            "pos_embedding, predictor)."
        )
    query_width, model_dim = arrays[key].shape
    if query_width % n_heads or model_dim % n_heads:
        raise ValueError(
            f"generator_config: n_heads={n_heads} does not divide the query width "
            f"{query_width} and model width {model_dim} of these weights."
        )
    kwargs = dict(
        n_layers=_layer_count(arrays, "transformer.layers."),
        n_heads=n_heads,
        query_dimensions=query_width // n_heads,
        value_dimensions=model_dim // n_heads,
        feed_forward_dimensions=arrays["transformer.layers.0.linear1.weight"].shape[0]
        if "transformer.layers.0.linear1.weight" in arrays
        else 4 * model_dim,
        attention_type=attention_type,
        dropout=0.1,
        attention_dropout=0.1,
    )
    kwargs.update(builder_kwargs)
    if kwargs["attention_type"] in ("linear", "causal-linear"):
        kwargs.pop("attention_dropout")  # linear attention takes none: no warning for defaults
    return config_from_builder_kwargs(**kwargs)


def image_generator_from_fast_transformers(
    state_dict: Mapping[str, Any], config: TransformerConfig
) -> ImageGenerator:
    """Our `ImageGenerator` with the weights of the authors' demo `Generator` /
    `RecurrentGenerator` (value embedding ++ interleaved sine/cosine positions, their encoder,
    a mixture-of-logistics predictor).

    Their convention is kept as the model's options rather than mapped onto ours, because it
    is a different model: no START token (position t reads x_t and predicts x_{t+1}, so x_0 has
    no distribution and is never scored: `start_token=False`), and positions interleaved
    sin, cos, sin, ... (`position_layout="interleaved"`). Their head was trained with the
    PixelCNN++ loss, whose parametrisation (logits | means | log-scales floored at -7, bins
    of half-width 1/255 around -1 + 2c/255) is ours, so it maps as is. `max_length` (sub-pixels
    per image) is one more than the rows of their position table, whose values are checked.
    Sampling needs a prefix of at least one sub-pixel, as the demo forces the first one.
    `config`: `generator_config(state_dict, attention_type=..., n_heads=...)` reads it from the
    weights.
    """
    _check_config(config, "image_generator_from_fast_transformers")
    loader = _Loader(state_dict, "image_generator_from_fast_transformers")
    for key in ("value_embedding.weight", "predictor.weight", "pos_embedding.pe"):
        if key not in loader.arrays:
            raise ValueError(
                f"image_generator_from_fast_transformers: the state dict has no "
                f"{key!r}; expected the colab's Generator / RecurrentGenerator."
            )
    num_classes = loader.arrays["value_embedding.weight"].shape[0]
    num_outputs = loader.arrays["predictor.weight"].shape[0]
    if num_outputs % 3:
        raise ValueError(
            f"image_generator_from_fast_transformers: 'predictor.weight' has "
            f"{num_outputs} outputs; a mixture of logistics has 3 per component."
        )
    table = loader.arrays["pos_embedding.pe"]
    if table.ndim != 3 or table.shape[0] != 1 or table.shape[2] != config.model_dim - config.model_dim // 2:
        raise ValueError(
            f"image_generator_from_fast_transformers: 'pos_embedding.pe' has shape "
            f"{tuple(table.shape)}; expected (1, positions, "
            f"{config.model_dim - config.model_dim // 2})."
        )
    model = ImageGenerator(
        config,
        num_classes=num_classes,
        num_mixtures=num_outputs // 3,
        max_length=table.shape[1] + 1,
        start_token=False,
        position_layout="interleaved",
        rngs=nnx.Rngs(0),
    )
    _check_position_table(table[0])
    loader.unused.discard("pos_embedding.pe")
    loader.take("value_embedding.weight", model.embed.embedding)
    _load_encoder(loader, model.transformer, "transformer.", config)
    loader.linear("predictor", model.head)
    loader.finish()
    model.eval()
    return model


def _check_position_table(table_TE: np.ndarray):
    """Their `pe` buffer must be the interleaved sine/cosine table our model computes."""
    T, E = table_TE.shape
    expected = np.asarray(sinusoidal_encoding(np.arange(T), E, layout="interleaved"))
    # Their float32 table rounds angles up to ~T: an ulp of 783 is 6e-5.
    error = float(np.max(np.abs(table_TE - expected)))
    if not error < 1e-3:
        raise ValueError(
            f"image_generator_from_fast_transformers: 'pos_embedding.pe' is not the "
            f"interleaved sine/cosine table (max difference {error:.3g}); this "
            "converter reads the colab's PositionalEncoding only."
        )
