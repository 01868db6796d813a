"""The keyword arguments of the authors' transformer builders, as `TransformerConfig` fields.

pytorch-fast-transformers builds models with `TransformerEncoderBuilder.from_kwargs(...)` (and
the recurrent and decoder builders). `builder_fields` takes every argument those builders take,
with their defaults, and returns the fields of the config of the same model
(`interop.config_from_builder_kwargs` builds it):

- model width n_heads * value_dimensions; feed_forward_dimensions 1024, query/value
  dimensions 64, 4 layers and heads, dropout 0.1, relu, final LayerNorm, PyTorch's LayerNorm
  epsilon 1e-5, as the builders default;
- attention_type "full" (their default) is our "softmax", with their attention_dropout default
  0.1; "linear" and "causal-linear" keep their names; "reformer" maps onto ours (see below);
- decoder builders' self_attention_type / cross_attention_type (both "full" by default);
- an attention argument that the chosen kind does not take (attention_dropout or softmax_temp
  with linear attention, as in their docs' own example) is ignored, as their builder ignores
  it, with a warning naming it; event_dispatcher (we dispatch no events) likewise;
- strict=False ignores unknown names (with a warning), as theirs does; strict=True (default)
  refuses them.

What cannot be reproduced is an error rather than a different model: their clustered,
improved-clustered, conditional-full, exact-topk and local kinds; a feature_map given as a
PyTorch callable (name it instead: "elu", "relu", "favor"); reformer's `bits` and
`masked=False` (our LSH attention hashes into `num_buckets` buckets and always masks a query
from itself while other keys are in reach) or a non-zero attention_dropout for reformer.
"""

from __future__ import annotations

import warnings

# The builders' own parameters and defaults (BaseTransformerBuilder).
_BUILDER_DEFAULTS = {
    "n_layers": 4,
    "n_heads": 4,
    "query_dimensions": 64,
    "value_dimensions": 64,
    "feed_forward_dimensions": 1024,
    "dropout": 0.1,
    "activation": "relu",
    "final_normalization": True,
    "event_dispatcher": "",
}
_ENCODER_KIND_ARGS = ("attention_type",)
_DECODER_KIND_ARGS = ("self_attention_type", "cross_attention_type")

# Each kind of their AttentionRegistry and the parameters it takes (query_dimensions and
# event_dispatcher, which every builder sets, left out).
_KIND_PARAMS = {
    "full": ("softmax_temp", "attention_dropout"),
    "linear": ("feature_map",),
    "causal-linear": ("feature_map",),
    "reformer": ("chunk_size", "bits", "rounds", "masked", "softmax_temp", "attention_dropout"),
    "clustered": ("clusters", "iterations", "bits", "hash_bias", "softmax_temp", "attention_dropout"),
    "improved-clustered": (
        "clusters",
        "iterations",
        "bits",
        "hash_bias",
        "topk",
        "softmax_temp",
        "attention_dropout",
    ),
    "improved-causal": (
        "clusters",
        "iterations",
        "bits",
        "hash_bias",
        "topk",
        "softmax_temp",
        "attention_dropout",
    ),
    "conditional-full": ("length_limit", "softmax_temp", "attention_dropout"),
    "exact-topk": ("topk", "softmax_temp", "attention_dropout"),
    "local": ("local_context", "softmax_temp", "attention_dropout"),
}
_ATTENTION_PARAMS = sorted({p for params in _KIND_PARAMS.values() for p in params})
_OUR_KIND = {"full": "softmax", "linear": "linear", "causal-linear": "causal-linear", "reformer": "reformer"}
_FEATURE_MAPS = (None, "elu", "relu", "favor")
_ATTENTION_DROPOUT_DEFAULT = 0.1

KNOWN_ARGUMENTS = tuple(
    sorted(
        set(_BUILDER_DEFAULTS)
        | set(_ENCODER_KIND_ARGS)
        | set(_DECODER_KIND_ARGS)
        | set(_ATTENTION_PARAMS)
        | {"strict"}
    )
)


def _warn(message: str):
    warnings.warn(f"config_from_builder_kwargs: {message}", UserWarning, stacklevel=4)


def _check_kind(name: str, kind) -> str:
    if kind in _OUR_KIND:
        return kind
    if isinstance(kind, str) and (":" in kind or "," in kind):
        raise ValueError(
            f"config_from_builder_kwargs: {name}={kind!r}: composed attention types (the authors' "
            f"'outer:inner' decorations) are not implemented here; available: "
            f"{sorted(_OUR_KIND)}."
        )
    if kind in _KIND_PARAMS:
        raise ValueError(
            f"config_from_builder_kwargs: {name}={kind!r} (the authors' {kind} attention) is not "
            f"implemented here; available: {sorted(_OUR_KIND)}."
        )
    raise ValueError(
        f"config_from_builder_kwargs: {name}={kind!r} is not one of the authors' attention types "
        f"{sorted(_KIND_PARAMS)}."
    )


def _options(kind: str, given: dict, where: str) -> dict:
    """Our attention options for their `kind` from the attention arguments `given`."""
    if kind == "full":
        options = {"attention_dropout": given.get("attention_dropout", _ATTENTION_DROPOUT_DEFAULT)}
        if given.get("softmax_temp") is not None:
            options["softmax_temp"] = given["softmax_temp"]
        return options
    if kind in ("linear", "causal-linear"):
        feature_map = given.get("feature_map")
        if feature_map not in _FEATURE_MAPS:
            raise ValueError(
                f"config_from_builder_kwargs: feature_map={feature_map!r}: give the feature map by "
                f"name, one of {list(_FEATURE_MAPS)} (None is the authors' default, elu(x) + 1)."
            )
        return {} if feature_map is None else {"feature_map": feature_map}
    # reformer
    if "bits" in given:
        raise ValueError(
            f"config_from_builder_kwargs: bits={given['bits']!r} ({where} reformer): this LSH "
            "attention hashes into num_buckets buckets rather than sorting by a "
            "bits-wide hash; set TransformerConfig(attention_options="
            "{'num_buckets': ...}) instead."
        )
    if given.get("masked", True) is not True:
        raise ValueError(
            f"config_from_builder_kwargs: masked={given['masked']!r} ({where} reformer): this LSH "
            "attention always masks a query from its own key while other keys are "
            "in reach (masked=True); it has no unmasked form."
        )
    if given.get("attention_dropout", 0.0):
        raise ValueError(
            f"config_from_builder_kwargs: attention_dropout={given['attention_dropout']!r} "
            f"({where} reformer): this LSH attention has no attention dropout; "
            "pass attention_dropout=0."
        )
    if "masked" not in given or "attention_dropout" not in given:
        _warn(
            f"{where} reformer differs from the authors' defaults: it masks a query from its "
            "own key (their masked=False), hashes into num_buckets=8 buckets (their bits) and "
            "has no attention dropout (their 0.1)."
        )
    options = {}
    if "rounds" in given:
        options["num_rounds"] = given["rounds"]
    if "chunk_size" in given:
        options["chunk_size"] = given["chunk_size"]
    if given.get("softmax_temp") is not None:
        options["softmax_temp"] = given["softmax_temp"]
    return options


def builder_fields(**kwargs) -> dict:
    """The `TransformerConfig` fields of the model the authors' builder makes from `kwargs`."""
    strict = kwargs.pop("strict", True)
    unknown = sorted(set(kwargs) - set(KNOWN_ARGUMENTS))
    if unknown and strict:
        raise ValueError(
            f"config_from_builder_kwargs: unknown arguments {unknown} (the authors' builders have "
            f"no such parameter); known: {list(KNOWN_ARGUMENTS)}."
        )
    if unknown:
        _warn(f"ignoring {unknown}: not parameters of the authors' builders (strict=False).")
        kwargs = {k: v for k, v in kwargs.items() if k not in unknown}
    if set(kwargs) & set(_ENCODER_KIND_ARGS) and set(kwargs) & set(_DECODER_KIND_ARGS):
        raise ValueError(
            "config_from_builder_kwargs: attention_type is an encoder builder's argument and "
            "self_attention_type / cross_attention_type a decoder builder's; give "
            "one builder's."
        )
    if kwargs.get("event_dispatcher", ""):
        _warn(
            f"ignoring event_dispatcher={kwargs['event_dispatcher']!r}: no attention events "
            "are dispatched here."
        )
    builder = {k: kwargs.get(k, v) for k, v in _BUILDER_DEFAULTS.items()}
    attention_args = {k: kwargs[k] for k in _ATTENTION_PARAMS if k in kwargs}

    decoder = bool(set(kwargs) & set(_DECODER_KIND_ARGS))
    if decoder:
        kinds = {
            "self": _check_kind("self_attention_type", kwargs.get("self_attention_type", "full")),
            "cross": _check_kind("cross_attention_type", kwargs.get("cross_attention_type", "full")),
        }
    else:
        kinds = {"self": _check_kind("attention_type", kwargs.get("attention_type", "full"))}
    taken = {p for kind in kinds.values() for p in _KIND_PARAMS[kind]}
    ignored = sorted(set(attention_args) - taken)
    if ignored:
        _warn(
            f"ignoring {ignored}: the authors' builder ignores them for "
            f"{' and '.join(sorted(set(kinds.values())))} attention too."
        )
    options = {
        role: _options(
            kind, {k: v for k, v in attention_args.items() if k in _KIND_PARAMS[kind]}, role + "-attention"
        )
        for role, kind in kinds.items()
    }
    fields = dict(
        num_layers=builder["n_layers"],
        num_heads=builder["n_heads"],
        model_dim=builder["n_heads"] * builder["value_dimensions"],
        query_dim=builder["query_dimensions"],
        value_dim=builder["value_dimensions"],
        feed_forward_dim=builder["feed_forward_dimensions"],
        activation=builder["activation"],
        dropout=builder["dropout"],
        final_normalization=bool(builder["final_normalization"]),
        layer_norm_epsilon=1e-5,
        attention=_OUR_KIND[kinds["self"]],
        attention_options=options["self"],
    )
    if decoder:
        fields.update(cross_attention=_OUR_KIND[kinds["cross"]], cross_attention_options=options["cross"])
    return fields
