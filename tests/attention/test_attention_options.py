"""Each attention kind's options are one frozen dataclass, validated once where they are given."""

import dataclasses
import inspect
import re

import chex
import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from experiments.training import config_checks
from linear_transformers import (
    AttentionCore,
    Decoder,
    Encoder,
    MultiHeadAttention,
    TransformerConfig,
    attention,
    ops,
    register_attention,
)
from linear_transformers.attention import (
    LinearOptions,
    LinformerOptions,
    NoOptions,
    ReformerOptions,
    SoftmaxOptions,
    attention_class,
    attention_options,
    check_attention_options,
    make_attention_core,
    registered_attention_kinds,
    unregister_attention,
)

E, H = 16, 2

# Every kind's options and defaults, as the constructors' keyword arguments had them.
DEFAULTS = {
    "softmax": (
        SoftmaxOptions,
        dict(softmax_temp=None, attention_dropout=0.0, implementation=None, sow_weights=False),
    ),
    "linear": (
        LinearOptions,
        dict(feature_map="elu", num_features=None, implementation="chunked", chunk_size=None, eps=1e-6),
    ),
    "causal-linear": (
        LinearOptions,
        dict(feature_map="elu", num_features=None, implementation="chunked", chunk_size=None, eps=1e-6),
    ),
    "reformer": (ReformerOptions, dict(num_buckets=8, num_rounds=4, chunk_size=32, softmax_temp=None)),
    "linformer": (
        LinformerOptions,
        dict(max_length=None, projected_length=64, share_kv=False, softmax_temp=None),
    ),
}
# Options a layer of each kind can be built with (linformer needs max_length), and its causality.
BUILDABLE = {
    "softmax": ({"softmax_temp": 0.5}, True),
    "linear": ({"implementation": "scan"}, False),
    "causal-linear": ({"chunk_size": 4}, True),
    "reformer": ({"chunk_size": 4}, True),
    "linformer": ({"max_length": 8}, False),
}


def _listed(names) -> str:
    return re.escape(str(sorted(names)))


@pytest.mark.parametrize("kind", list(DEFAULTS))
def test_each_kinds_options_class_has_todays_options_and_defaults(kind):
    options_class, defaults = DEFAULTS[kind]
    assert attention_class(kind).options_class is options_class
    assert dataclasses.is_dataclass(options_class) and options_class.__dataclass_params__.frozen
    assert dataclasses.asdict(options_class()) == defaults
    assert attention_options(kind) == sorted(defaults)
    assert check_attention_options(kind, {}) == options_class()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options_class().softmax_temp = 1.0


@pytest.mark.parametrize("kind", list(BUILDABLE))
def test_the_core_keeps_the_one_options_object_it_was_built_with(kind):
    given, causal = BUILDABLE[kind]
    options_class = DEFAULTS[kind][0]
    core = make_attention_core(
        kind, causal=causal, num_heads=H, head_dim=8, value_dim=8, rngs=nnx.Rngs(0), options=given
    )
    assert core.options == options_class(**given)
    mha = MultiHeadAttention(E, H, kind=kind, causal=causal, attention_options=given, rngs=nnx.Rngs(0))
    assert mha.core.options == options_class(**given)
    # An instance is taken as it is.
    instance = options_class(**given)
    mha = MultiHeadAttention(E, H, kind=kind, causal=causal, attention_options=instance, rngs=nnx.Rngs(0))
    assert mha.core.options is instance


@pytest.mark.parametrize("kind", list(DEFAULTS))
def test_an_unknown_option_is_named_with_the_kinds_options(kind):
    allowed = DEFAULTS[kind][1]
    match = (
        rf"attention kind '{kind}' does not accept options \['bogus'\]; its options are {_listed(allowed)}\."
    )
    with pytest.raises(ValueError, match=match):
        check_attention_options(kind, {"bogus": 1})
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(E, H, kind=kind, causal=True, attention_options={"bogus": 1}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        make_attention_core(
            kind, causal=True, num_heads=H, head_dim=8, value_dim=8, rngs=nnx.Rngs(0), options={"bogus": 1}
        )
    with pytest.raises(ValueError, match=match):
        TransformerConfig(model_dim=E, num_heads=H, attention=kind, attention_options={"bogus": 1})
    config = ml_collections.ConfigDict({"attention": kind, "attention_options": {"bogus": 1}})
    with pytest.raises(ValueError, match="config.attention_options: " + match):
        config_checks.check_attention(config)


BAD_VALUES = [
    ("softmax", {"implementation": "flash"}, r"unknown implementation 'flash'; expected one of "),
    ("softmax", {"attention_dropout": 1.0}, r"attention_dropout must be in \[0, 1\)"),
    ("linear", {"implementation": "fast"}, r"unknown implementation 'fast'; expected one of "),
    ("causal-linear", {"implementation": "fast"}, r"unknown implementation 'fast'; expected one of "),
    ("linear", {"chunk_size": 0}, r"chunk_size must be None or an integer >= 1, got 0"),
    ("causal-linear", {"eps": -1.0}, r"linear attention: eps .* must be a finite number >= 0 .*got -1.0"),
    ("linear", {"feature_map": "tanh"}, r"unknown feature map 'tanh'; registered feature maps: "),
    ("linear", {"num_features": 8}, r"feature map 'elu' does not take it"),
    ("linear", {"feature_map": "favor", "num_features": 0}, r"num_features must be None or an integer >= 1"),
    ("reformer", {"num_buckets": 3}, r"num_buckets must be 1 or an even integer >= 2"),
    ("reformer", {"num_rounds": 0}, r"num_rounds must be an integer >= 1"),
    ("linformer", {"projected_length": 0}, r"projected_length must be an integer >= 1, got 0\."),
    ("linformer", {"max_length": 0}, r"max_length must be an integer >= 1, got 0 \(it is required"),
]


@pytest.mark.parametrize("kind, options, match", BAD_VALUES)
def test_a_bad_value_is_the_options_class_error_wherever_it_is_given(kind, options, match):
    options_class = DEFAULTS[kind][0]
    with pytest.raises(ValueError, match=match):
        options_class(**options)
    with pytest.raises(ValueError, match=match):
        check_attention_options(kind, options)
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(E, H, kind=kind, causal=True, attention_options=options, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):  # at the config, before any layer
        TransformerConfig(model_dim=E, num_heads=H, attention=kind, attention_options=options)
    config = ml_collections.ConfigDict({"attention": kind, "attention_options": options})
    with pytest.raises(ValueError, match="config.attention_options: .*" + match):
        config_checks.check_attention(config)


def test_bad_value_errors_list_the_allowed_values():
    with pytest.raises(ValueError) as info:
        LinearOptions(implementation="fast")
    assert str(ops.LINEAR_IMPLEMENTATIONS) in str(info.value)
    with pytest.raises(ValueError) as info:
        SoftmaxOptions(implementation="flash")
    assert str(ops.softmax.IMPLEMENTATIONS) in str(info.value)
    with pytest.raises(ValueError) as info:
        LinearOptions(feature_map="tanh")
    assert all(name in str(info.value) for name in ops.registered_feature_maps())


def test_linformer_max_length_is_required_by_the_layer_not_the_options():
    # A config may leave it to the trainer (which fills in its longest source)...
    assert LinformerOptions().max_length is None
    TransformerConfig(model_dim=E, num_heads=H, attention="linformer")
    config_checks.check_attention(
        ml_collections.ConfigDict({"attention": "linformer", "attention_options": {}})
    )
    # ...but a layer cannot be built without it.
    with pytest.raises(ValueError, match=r"max_length must be an integer >= 1, got None \(it is required"):
        MultiHeadAttention(E, H, kind="linformer", rngs=nnx.Rngs(0))


def test_causal_linear_and_linear_share_linear_options():
    linear, causal_linear = attention_class("linear"), attention_class("causal-linear")
    assert linear.options_class is causal_linear.options_class is LinearOptions
    assert attention_options("causal-linear") == attention_options("linear")
    # No restated signature: the options reach the core as one object.
    assert not set(attention_options("linear")) & set(inspect.signature(causal_linear.__init__).parameters)
    options = LinearOptions(feature_map="favor", num_features=6, implementation="scan")
    a = MultiHeadAttention(E, H, kind="linear", causal=True, attention_options=options, rngs=nnx.Rngs(0))
    b = MultiHeadAttention(
        E, H, kind="causal-linear", causal=True, attention_options=options, rngs=nnx.Rngs(0)
    )
    assert a.core.options is b.core.options is options
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 5, E)))
    chex.assert_trees_all_close(a(x), b(x))
    with pytest.raises(ValueError, match="causal by definition"):
        MultiHeadAttention(E, H, kind="causal-linear", attention_options=options, rngs=nnx.Rngs(0))


def test_an_options_object_of_another_kind_is_refused():
    with pytest.raises(ValueError, match=r"'linear' takes its options as a mapping or a LinearOptions, got "):
        MultiHeadAttention(E, H, kind="linear", attention_options=SoftmaxOptions(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"takes its options as one LinearOptions"):
        attention_class("linear")(
            causal=True, num_heads=H, head_dim=8, value_dim=8, rngs=nnx.Rngs(0), options=SoftmaxOptions()
        )


def test_attention_dropout_and_softmax_temp_join_an_options_object():
    base = SoftmaxOptions(implementation="reference")
    mha = MultiHeadAttention(
        E,
        H,
        kind="softmax",
        attention_options=base,
        attention_dropout=0.1,
        softmax_temp=0.5,
        rngs=nnx.Rngs(0),
    )
    assert mha.core.options == SoftmaxOptions(
        implementation="reference", attention_dropout=0.1, softmax_temp=0.5
    )
    with pytest.raises(ValueError, match=r"'linear' does not accept options \['softmax_temp'\]"):
        MultiHeadAttention(
            E, H, kind="linear", attention_options=LinearOptions(), softmax_temp=0.5, rngs=nnx.Rngs(0)
        )


def test_a_transformer_config_validates_the_options_once(monkeypatch):
    calls = []
    post_init = LinearOptions.__post_init__

    def counted(self):
        calls.append(self)
        post_init(self)

    monkeypatch.setattr(LinearOptions, "__post_init__", counted)
    config = TransformerConfig(
        num_layers=3,
        model_dim=E,
        num_heads=H,
        attention="causal-linear",
        attention_options={"implementation": "scan"},
    )
    assert len(calls) == 2  # self-attention and (inherited) cross-attention, at the config
    decoder = Decoder(config, rngs=nnx.Rngs(0))
    assert len(calls) == 2  # none when the six attention layers are built
    assert decoder.layers.self_attention.core.options is config._core_options[0]
    assert decoder.layers.cross_attention.core.options.implementation == "scan"
    MultiHeadAttention(E, H, kind="linear", attention_options={"implementation": "scan"}, rngs=nnx.Rngs(0))
    assert len(calls) == 3


# --- a kind registered by a user ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScaledOptions:
    """Options of the test kind: a logit scale and whether to add a (zero) bias."""

    scale: float = 1.0
    bias: bool = False

    def __post_init__(self):
        if not self.scale > 0:
            raise ValueError(f"scaled attention: scale must be > 0, got {self.scale!r}.")


class ScaledSoftmax(AttentionCore):
    """Reference softmax attention with a fixed logit scale: a kind defined outside the library."""

    options_class = ScaledOptions

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        return ops.softmax_attention_reference(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            causal=self.causal,
            key_lengths=key_lengths,
            mask=mask,
            scale=self.options.scale,
        )


@pytest.fixture
def registry():
    """Kinds registered inside a test are unregistered afterwards."""
    before = set(registered_attention_kinds())
    yield
    for name in set(registered_attention_kinds()) - before:
        unregister_attention(name)


def test_a_user_registered_kind_with_its_own_options_works_end_to_end(registry):
    register_attention("test-scaled")(ScaledSoftmax)
    assert attention_options("test-scaled") == ["bias", "scale"]
    with pytest.raises(
        ValueError,
        match=r"'test-scaled' does not accept options \['eps'\]; its options are \['bias', 'scale'\]",
    ):
        MultiHeadAttention(E, H, kind="test-scaled", attention_options={"eps": 1.0}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"scale must be > 0, got 0"):
        TransformerConfig(model_dim=E, num_heads=H, attention="test-scaled", attention_options={"scale": 0})

    mha = MultiHeadAttention(
        E, H, kind="test-scaled", causal=True, attention_options={"scale": 0.5}, rngs=nnx.Rngs(0)
    )
    assert mha.core.options == ScaledOptions(scale=0.5)
    ref = MultiHeadAttention(E, H, kind="softmax", causal=True, softmax_temp=0.5, rngs=nnx.Rngs(1))
    nnx.update(ref, nnx.state(mha, nnx.Param))
    x = np.asarray(jax.random.normal(jax.random.key(2), (2, 5, E)))
    chex.assert_trees_all_close(mha(x), ref(x), atol=1e-5)

    config = TransformerConfig(
        num_layers=1,
        model_dim=E,
        num_heads=H,
        dropout=0.0,
        attention="test-scaled",
        attention_options={"scale": 0.5},
    )
    y = Encoder(config, rngs=nnx.Rngs(0))(x)
    chex.assert_shape(y, x.shape)
    chex.assert_tree_all_finite(y)


def test_a_kind_without_options_class_takes_no_options(registry):
    @register_attention("test-plain")
    class Plain(AttentionCore):
        """Reference softmax attention with no options."""

        def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
            return ops.softmax_attention_reference(
                q_BTHD, k_BSHD, v_BSHM, causal=self.causal, key_lengths=key_lengths
            )

    assert Plain.options_class is NoOptions and attention_options("test-plain") == []
    assert MultiHeadAttention(E, H, kind="test-plain", rngs=nnx.Rngs(0)).core.options == NoOptions()
    with pytest.raises(
        ValueError, match=r"'test-plain' does not accept options \['scale'\]; its options are \[\]"
    ):
        MultiHeadAttention(E, H, kind="test-plain", attention_options={"scale": 1.0}, rngs=nnx.Rngs(0))


def test_registering_a_kind_that_breaks_the_protocol_is_a_clear_error(registry):
    with pytest.raises(
        TypeError, match=r"takes no `options`.*declare the options as fields of options_class"
    ):

        @register_attention("test-old-style")
        class OldStyle(AttentionCore):
            """Options as constructor arguments, as kinds declared them before options classes."""

            def __init__(
                self, *, causal, num_heads, head_dim, value_dim, rngs, sequence_axis=None, scale=1.0
            ):
                super().__init__(
                    causal=causal, num_heads=num_heads, head_dim=head_dim, value_dim=value_dim, rngs=rngs
                )

    @dataclasses.dataclass
    class Mutable:
        """Not frozen."""

        scale: float = 1.0

    with pytest.raises(TypeError, match=r"options_class must be a frozen dataclass"):
        register_attention("test-mutable")(type("MutableKind", (AttentionCore,), {"options_class": Mutable}))
    with pytest.raises(TypeError, match=r"not a subclass of AttentionCore"):
        register_attention("test-not-a-core")(ScaledOptions)
    assert "test-old-style" not in attention.registered_attention_kinds()


def test_a_kind_with_a_required_option_names_it(registry):
    @dataclasses.dataclass(frozen=True)
    class Needs:
        """An option without a default."""

        width: int

    register_attention("test-needs")(type("NeedsKind", (ScaledSoftmax,), {"options_class": Needs}))
    with pytest.raises(
        ValueError, match=r"'test-needs' needs options \['width'\]; its options are \['width'\]"
    ):
        check_attention_options("test-needs", {})
    assert check_attention_options("test-needs", {"width": 3}) == Needs(3)


def test_unregistering_a_kind_frees_its_name_and_names_the_registered_ones(registry):
    register_attention("test-scaled")(ScaledSoftmax)
    with pytest.raises(ValueError, match="'test-scaled' is already registered"):
        register_attention("test-scaled")(ScaledSoftmax)
    assert unregister_attention("test-scaled") is ScaledSoftmax
    assert "test-scaled" not in registered_attention_kinds()
    register_attention("test-scaled")(ScaledSoftmax)  # a new version under the same name
    with pytest.raises(ValueError, match=r"'nope' is not registered; registered: \[.*'linear'"):
        unregister_attention("nope")
