"""`interop.config_from_builder_kwargs` takes the authors' builder arguments, with their defaults.

The examples are those of pytorch-fast-transformers' builder docstrings and of the authors'
demo colab. When the library is importable, each example's model is also built there and its
weights load into ours (same names, same shapes).
"""

from __future__ import annotations

import warnings

import pytest

from linear_transformers.interop import config_from_builder_kwargs
from linear_transformers.transformer import TransformerConfig

# The builders' docstring examples (TransformerEncoderBuilder, RecurrentEncoderBuilder,
# TransformerDecoderBuilder, RecurrentDecoderBuilder) and the colab's uses.
_COMMON = dict(
    n_layers=12,
    n_heads=8,
    feed_forward_dimensions=1024,
    query_dimensions=64,
    value_dimensions=64,
    dropout=0.1,
    attention_dropout=0.1,
)
ENCODER_EXAMPLE = dict(_COMMON, attention_type="linear")
DECODER_EXAMPLE = dict(_COMMON, self_attention_type="full", cross_attention_type="full")
COLAB_FIRST_STEPS = dict(
    n_layers=4,
    n_heads=4,
    feed_forward_dimensions=128,
    query_dimensions=32,
    value_dimensions=32,
    attention_type="full",
)
COLAB_GENERATOR = dict(
    attention_type="linear",
    n_layers=8,
    n_heads=8,
    feed_forward_dimensions=8 * 32 * 4,
    query_dimensions=32,
    value_dimensions=32,
    dropout=0.1,
    softmax_temp=None,
    attention_dropout=0.1,
)
COLAB_BENCHMARK = dict(
    n_layers=1, n_heads=12, query_dimensions=64, value_dimensions=64, feed_forward_dimensions=768
)


def _quiet(**kwargs) -> TransformerConfig:
    """config_from_builder_kwargs that must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return config_from_builder_kwargs(**kwargs)


def test_defaults_are_the_builders():
    config = _quiet()
    assert (config.num_layers, config.num_heads, config.head_query_dim, config.head_value_dim) == (
        4,
        4,
        64,
        64,
    )
    assert (config.model_dim, config.hidden_dim) == (256, 1024)
    assert (config.dropout, config.activation, config.final_normalization) == (0.1, "relu", True)
    # Their default kind is full softmax with attention dropout 0.1, and PyTorch's LayerNorm.
    assert config.attention == "softmax"
    assert dict(config.attention_options) == {"attention_dropout": 0.1}
    assert config.layer_norm_epsilon == 1e-5


def test_the_encoder_docstring_example_ignores_attention_dropout_with_a_warning():
    # Their example sets attention_dropout with linear attention, which their builder ignores.
    with pytest.warns(UserWarning, match=r"ignoring \['attention_dropout'\].*linear attention"):
        config = config_from_builder_kwargs(**ENCODER_EXAMPLE)
    assert (config.num_layers, config.model_dim, config.hidden_dim) == (12, 512, 1024)
    assert config.attention == "linear" and dict(config.attention_options) == {}
    assert config.attention_dropout == 0.0


def test_the_decoder_docstring_example():
    config = _quiet(**DECODER_EXAMPLE)
    assert config.attention == "softmax" and config.cross_kind == "softmax"
    assert dict(config.attention_options) == {"attention_dropout": 0.1}
    assert dict(config.cross_options) == {"attention_dropout": 0.1}


def test_the_colab_examples():
    config = _quiet(**COLAB_FIRST_STEPS)
    assert (config.model_dim, config.hidden_dim, config.attention) == (128, 128, "softmax")
    with pytest.warns(UserWarning, match=r"ignoring \['attention_dropout', 'softmax_temp'\]"):
        config = config_from_builder_kwargs(**COLAB_GENERATOR)
    assert (config.num_layers, config.model_dim, config.hidden_dim) == (8, 256, 1024)
    assert config.attention == "linear"
    config = _quiet(**COLAB_BENCHMARK)
    assert (config.num_heads, config.model_dim, config.hidden_dim) == (12, 768, 768)


def test_a_decoder_cross_attention_defaults_to_full_as_theirs():
    # Ours would pick linear cross-attention for a causal-linear decoder; their builder "full".
    config = _quiet(self_attention_type="causal-linear")
    assert config.attention == "causal-linear" and config.cross_kind == "softmax"
    assert dict(config.cross_options) == {"attention_dropout": 0.1}
    config = _quiet(self_attention_type="causal-linear", cross_attention_type="linear", feature_map="relu")
    assert config.cross_kind == "linear" and dict(config.cross_options) == {"feature_map": "relu"}


def test_options_go_to_the_kind_that_takes_them():
    config = _quiet(
        self_attention_type="causal-linear",
        cross_attention_type="full",
        softmax_temp=0.5,
        attention_dropout=0.2,
    )
    assert dict(config.attention_options) == {}
    assert dict(config.cross_options) == {"attention_dropout": 0.2, "softmax_temp": 0.5}


def test_reformer_maps_its_options_and_names_what_differs():
    with pytest.warns(UserWarning, match=r"reformer differs from the authors' defaults"):
        config = config_from_builder_kwargs(attention_type="reformer", rounds=8, chunk_size=16)
    assert config.attention == "reformer"
    assert dict(config.attention_options) == {"num_rounds": 8, "chunk_size": 16}
    config = _quiet(attention_type="reformer", masked=True, attention_dropout=0.0)
    with pytest.raises(ValueError, match=r"bits=32 .*num_buckets"):
        config_from_builder_kwargs(attention_type="reformer", bits=32)
    with pytest.raises(ValueError, match=r"masked=False .*no unmasked form"):
        config_from_builder_kwargs(attention_type="reformer", masked=False)
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 .*no attention dropout"):
        config_from_builder_kwargs(attention_type="reformer", attention_dropout=0.1)


def test_arguments_for_other_kinds_are_ignored_with_a_warning_naming_them():
    with pytest.warns(UserWarning, match=r"ignoring \['clusters', 'topk'\].*softmax|full"):
        config = config_from_builder_kwargs(attention_type="full", clusters=100, topk=32)
    assert config.attention == "softmax"
    with pytest.warns(UserWarning, match=r"ignoring \['feature_map'\]"):
        config_from_builder_kwargs(attention_type="full", feature_map="elu")
    with pytest.warns(UserWarning, match=r"event_dispatcher='mine'"):
        config_from_builder_kwargs(event_dispatcher="mine")


def test_what_cannot_be_built_here_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"attention_type='clustered' .*not implemented here"):
        config_from_builder_kwargs(attention_type="clustered", clusters=10)
    with pytest.raises(ValueError, match=r"'conditional-full:linear': composed attention types"):
        config_from_builder_kwargs(attention_type="conditional-full:linear")
    with pytest.raises(ValueError, match=r"attention_type='bogus' is not one of the authors'"):
        config_from_builder_kwargs(attention_type="bogus")
    with pytest.raises(ValueError, match=r"feature_map=<function .*give the feature map by name"):
        config_from_builder_kwargs(attention_type="linear", feature_map=lambda d: None)
    with pytest.raises(ValueError, match=r"attention_type is an encoder builder's argument"):
        config_from_builder_kwargs(attention_type="full", self_attention_type="full")
    with pytest.raises(ValueError, match=r"cross_attention 'reformer' shares queries and keys"):
        config_from_builder_kwargs(
            self_attention_type="full", cross_attention_type="reformer", masked=True, attention_dropout=0.0
        )


def test_unknown_names_follow_strict_as_theirs_do():
    with pytest.raises(ValueError, match=r"unknown arguments \['n_layer'\]"):
        config_from_builder_kwargs(n_layer=3)
    with pytest.warns(UserWarning, match=r"ignoring \['n_layer'\].*strict=False"):
        config = config_from_builder_kwargs(n_layer=3, n_layers=2, strict=False)
    assert config.num_layers == 2


@pytest.mark.parametrize(
    "example",
    [ENCODER_EXAMPLE, COLAB_FIRST_STEPS, COLAB_GENERATOR, COLAB_BENCHMARK, DECODER_EXAMPLE],
    ids=["encoder", "colab-first-steps", "colab-generator", "colab-benchmark", "decoder"],
)
def test_live_the_authors_model_from_the_same_arguments_loads_into_ours(example):
    pytest.importorskip("fast_transformers")
    from fast_transformers.builders import TransformerDecoderBuilder, TransformerEncoderBuilder

    from linear_transformers.interop import decoder_from_fast_transformers, encoder_from_fast_transformers

    example = dict(example, n_layers=1)  # the same layer, once: loading checks every shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        config = config_from_builder_kwargs(**example)
    if "self_attention_type" in example:
        theirs = TransformerDecoderBuilder.from_kwargs(**example).get()
        decoder_from_fast_transformers(theirs.state_dict(), config)
    else:
        theirs = TransformerEncoderBuilder.from_kwargs(**example).get()
        encoder_from_fast_transformers(theirs.state_dict(), config)


# --- the deprecated doors ------------------------------------------------------------------------


def test_the_deprecated_from_kwargs_warns_and_builds_the_same_config():
    with pytest.warns(DeprecationWarning, match=r"interop\.config_from_builder_kwargs"):
        config = TransformerConfig.from_kwargs(**COLAB_FIRST_STEPS)
    assert config == _quiet(**COLAB_FIRST_STEPS)
    # Its warnings about the arguments still point at the caller's line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TransformerConfig.from_kwargs(**ENCODER_EXAMPLE)
    assert [w.category for w in caught] == [DeprecationWarning, UserWarning]
    assert {w.filename for w in caught} == {__file__}


def test_the_old_builder_arguments_module_warns_on_use_and_hands_on_the_moved_names():
    import importlib

    from linear_transformers.interop import builder_arguments

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old = importlib.import_module("linear_transformers.builder_arguments")  # quiet
    with pytest.warns(DeprecationWarning, match=r"linear_transformers\.interop\.builder_arguments"):
        assert old.builder_fields is builder_arguments.builder_fields
    with pytest.warns(DeprecationWarning, match="builder_fields"):
        from linear_transformers.builder_arguments import builder_fields
    assert builder_fields is builder_arguments.builder_fields
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        old.bogus
