"""Flax NNX attention: one layer for every attention kind, with parallel and recurrent forms.

Legend: B batch, T query time, S key time, E model features, H heads, D key/query features per
head, M value features per head.

`MultiHeadAttention` owns the projections; the attention itself is an `AttentionCore` chosen by
name from a registry (`registered_attention_kinds()`). A core has one parallel form for training
and, where the kind allows, a recurrent form:

  core(q_BTHD, k_BSHD, v_BSHM, key_lengths=, mask=)   parallel
  core.init_state(batch, max_length, dtype)           causal self-attention state
  core.step(state, q_BHD, k_BHD, v_BHM)               -> (state, out_BHM), one token
  core.prefill(state, q_BTHD, k_BTHD, v_BTHM)         -> (state, out_BTHM), a block of T tokens
                                                      in parallel form, from and to a state
  core.init_memory(k_BSHD, v_BSHM, key_lengths)       cross-attention over a fixed memory,
  core.attend_memory(memory, q_BHD or q_BTHD)         computed once, queried per step or block

`prefill` equals T calls of `step` and leaves the same state, so a prompt is read in one
parallel pass and decoding goes on token by token (or block by block: streaming).

Sequence parallelism: a kind with `has_sequence_parallel_form` (softmax, linear, causal-linear)
built with `sequence_axis="name"` runs its parallel form with the time axis split over mesh axis
`name` (the ops wrap themselves in `jax.shard_map` under `jax.set_mesh(mesh)`; model code stays
in the global view).

Options: each kind declares them as one frozen dataclass, its `options_class` (`SoftmaxOptions`,
`LinearOptions` for both linear kinds, `ReformerOptions`, `LinformerOptions`): the fields are the
options a config may set, with their defaults, and `__post_init__` rejects unusable values.
`check_attention_options(kind, mapping)` builds it, so the options are validated once, where
they are given; the core receives the instance as `options=`.

New kinds subclass `AttentionCore`, set `options_class` to a frozen dataclass of their options
(a kind that sets none inherits `NoOptions` and takes no options), and register with
`@register_attention("name")`. The registry builds a core as `cls(causal=, num_heads=,
head_dim=, value_dim=, rngs=, sequence_axis=, param_dtype=, options=)`; a core passes them all
on to `AttentionCore.__init__`, which checks `sequence_axis` and keeps `options`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers import ops

_KINDS: dict[str, type["AttentionCore"]] = {}


def register_attention(name: str):
    """Class decorator registering an `AttentionCore` subclass under `name`.

    The class declares its options as `options_class`, a frozen dataclass (inherited `NoOptions`:
    none), and its constructor takes them as one instance, `options=` (see `AttentionCore`).
    Anything else is a TypeError here rather than a surprise when the kind is first built.
    """

    def wrap(cls):
        if name in _KINDS:
            raise ValueError(f"attention kind {name!r} is already registered.")
        _check_core_class(name, cls)
        _KINDS[name] = cls
        cls.kind = name
        return cls

    return wrap


def unregister_attention(name: str) -> type:
    """Remove kind `name` from the registry (e.g. to register a new version of it); returns
    its class. A ValueError lists the registered kinds if `name` is not one."""
    if name not in _KINDS:
        raise ValueError(f"attention kind {name!r} is not registered; registered: {sorted(_KINDS)}.")
    return _KINDS.pop(name)


def _check_core_class(name: str, cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, AttentionCore)):
        raise TypeError(f"attention kind {name!r}: {cls!r} is not a subclass of AttentionCore.")
    options_class = cls.options_class
    if not (
        isinstance(options_class, type)
        and dataclasses.is_dataclass(options_class)
        and options_class.__dataclass_params__.frozen
    ):
        raise TypeError(
            f"attention kind {name!r}: {cls.__name__}.options_class must be a frozen dataclass "
            f"(@dataclasses.dataclass(frozen=True)) whose fields are the kind's options, got "
            f"{options_class!r}; a kind without options leaves it unset (NoOptions)."
        )
    params = inspect.signature(cls.__init__).parameters
    if "options" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            f"attention kind {name!r}: {cls.__name__}.__init__ takes no `options`. A core "
            f"receives its options as one {options_class.__name__} instance, options=, beside "
            f"causal, num_heads, head_dim, value_dim, rngs, sequence_axis and param_dtype, and "
            f"passes them on to AttentionCore.__init__; declare the options as fields of "
            f"options_class rather than as constructor arguments."
        )


def registered_attention_kinds() -> list[str]:
    """Names accepted by `attention=` / `kind=`, sorted."""
    return sorted(_KINDS)


def attention_options(kind: str) -> list[str]:
    """The options attention `kind` accepts, sorted: the fields of its `options_class`."""
    return sorted(f.name for f in dataclasses.fields(attention_class(kind).options_class) if f.init)


def attention_class(kind: str) -> type["AttentionCore"]:
    """The core class registered as `kind`; an unknown kind lists the registered ones."""
    if kind not in _KINDS:
        raise ValueError(
            f"unknown attention kind {kind!r}; registered kinds: {registered_attention_kinds()}."
        )
    return _KINDS[kind]


def check_attention_options(kind: str, options: Mapping[str, Any] | Any) -> Any:
    """The options of attention `kind` as its `options_class` instance, validated.

    `options` is a mapping {option: value} (missing options take their defaults), or already an
    instance of the kind's `options_class` (returned as it is: it was validated when built). An
    option the kind does not accept, or a required one left out, is a ValueError listing the
    kind's options; an unusable value is the options class's ValueError.
    """
    options_class = attention_class(kind).options_class
    if isinstance(options, options_class):
        return options
    if not isinstance(options, Mapping):
        raise ValueError(
            f"attention kind {kind!r} takes its options as a mapping or a "
            f"{options_class.__name__}, got {type(options).__name__}."
        )
    allowed = attention_options(kind)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"attention kind {kind!r} does not accept options {unknown}; its options are {allowed}."
        )
    required = sorted(
        f.name
        for f in dataclasses.fields(options_class)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in options
    )
    if required:
        raise ValueError(f"attention kind {kind!r} needs options {required}; its options are {allowed}.")
    return options_class(**options)


def sequence_parallel_kinds() -> list[str]:
    """Registered kinds with a sequence-parallel form (`has_sequence_parallel_form`), sorted."""
    return [k for k in registered_attention_kinds() if _KINDS[k].has_sequence_parallel_form]


def check_sequence_axis(kind: str, sequence_axis) -> None:
    """Raise a ValueError unless `sequence_axis` is None, or a mesh axis name and attention
    `kind` has a sequence-parallel form."""
    _check_sequence_axis(attention_class(kind), sequence_axis)


def _check_sequence_axis(cls: type["AttentionCore"], sequence_axis) -> None:
    if sequence_axis is None:
        return
    kind = cls.kind
    if not isinstance(sequence_axis, str) or not sequence_axis:
        raise ValueError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}.")
    if not cls.has_sequence_parallel_form:
        raise ValueError(
            f"attention kind {kind!r} has no sequence-parallel form, so it cannot "
            f"run with sequence_axis={sequence_axis!r}; kinds with one: "
            f"{sequence_parallel_kinds()} (or use sequence_axis=None)."
        )


def make_attention_core(
    kind: str,
    *,
    causal: bool,
    num_heads: int,
    head_dim: int,
    value_dim: int,
    rngs: nnx.Rngs,
    sequence_axis: str | None = None,
    param_dtype=jnp.float32,
    **options,
) -> "AttentionCore":
    """Build the registered core `kind` from its options given as keywords.

    The options are validated once, by building the kind's `options_class` from them (an
    unknown option is a ValueError listing the kind's options); the core receives that instance.
    `sequence_axis` (a mesh axis name) is refused by kinds without a sequence-parallel form;
    `param_dtype` is the storage dtype of the parameters of kinds that have their own.
    """
    cls = attention_class(kind)
    return cls(
        causal=causal,
        num_heads=num_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        rngs=rngs,
        sequence_axis=sequence_axis,
        param_dtype=param_dtype,
        options=check_attention_options(kind, options),
    )


def check_inference_mode(module: nnx.Module):
    """Recurrent steps are for inference: refuse to run them with dropout switched on."""
    for _, m in nnx.iter_graph(module):
        if isinstance(m, nnx.Dropout) and m.rate > 0 and not m.deterministic:
            raise ValueError(
                "recurrent inference with dropout active: call model.eval() "
                "before init_state/step/prefill (and model.train() to train "
                "again)."
            )


def _prefill_axis(axis: str | None, length: int) -> str | None:
    """The sequence axis for a prefill block of `length` steps, or None to run it unsplit.

    Prefill is inference on prompts of any length, often outside any mesh: it splits time over
    `axis` only where that can work -- a mesh with the axis is set (or we are inside
    `jax.shard_map` over it) and `length` divides over its devices -- and otherwise runs on the
    arrays as they are, which gives the same result.
    """
    if axis is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return None
    if axis in mesh.manual_axes:
        return axis  # Inside shard_map the caller has split time already.
    return axis if length % mesh.shape[axis] == 0 else None


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a kind that takes none: `AttentionCore.options_class` by default."""


class AttentionCore(nnx.Module):
    """Attention after the projections: [B, T, H, D] queries to [B, T, H, M] outputs.

    A core is built as `cls(causal=, num_heads=, head_dim=, value_dim=, rngs=, sequence_axis=,
    param_dtype=, options=)`, where `options` is an instance of the kind's `options_class`
    (None: its defaults); `make_attention_core` and `MultiHeadAttention` build that instance
    from a mapping. The core keeps it as `self.options`; `param_dtype` is the storage dtype of
    the parameters of kinds that have their own (they read it in their constructor).

    Class attributes a kind may override:
      options_class: a frozen dataclass whose fields are the kind's options, with their
        defaults, and whose `__post_init__` raises a ValueError on an unusable value
        (default `NoOptions`: no options).
      has_recurrent_form: `init_state`/`step`/`prefill` reproduce the causal parallel form token
        by token (or block by block).
      has_sequence_parallel_form: the parallel form can split time over a mesh axis
        (`sequence_axis`); the core passes it to its ops.
      shares_query_key: the keys are derived from the queries (self-attention only), so
        `MultiHeadAttention` builds no key projection and passes the queries as `k`.
      no_recurrent_form_reason: why a kind has none, for the error message.
    """

    kind = "abstract"
    options_class: type = NoOptions
    has_recurrent_form = False
    has_sequence_parallel_form = False
    shares_query_key = False
    no_recurrent_form_reason = "it does not implement one"

    def __init__(
        self,
        *,
        causal: bool,
        num_heads: int,
        head_dim: int,
        value_dim: int,
        rngs: nnx.Rngs,
        sequence_axis: str | None = None,
        param_dtype=jnp.float32,
        options=None,
    ):
        options_class = type(self).options_class
        if options is None:
            options = options_class()
        elif not isinstance(options, options_class):
            raise ValueError(
                f"attention kind {self.kind!r} takes its options as one {options_class.__name__}, "
                f"got {options!r}; build cores from a mapping with make_attention_core."
            )
        _check_sequence_axis(type(self), sequence_axis)
        del param_dtype  # Kinds with parameters of their own read it in their constructor.
        self.options = options
        self.causal = causal
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.sequence_axis = sequence_axis

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        """Parallel form: [B, T, H, D] queries over [B, S, H, *] keys/values -> [B, T, H, M]."""
        raise NotImplementedError

    def init_state(self, batch: int, max_length: int | None, dtype=jnp.float32):
        """Empty recurrent state for causal self-attention (`max_length` steps at most)."""
        raise self._no_recurrent_form("init_state")

    def step(self, state, q_BHD, k_BHD, v_BHM):
        """One token of causal self-attention: (state, q_t, k_t, v_t) -> (state, out_t [B, H, M])."""
        raise self._no_recurrent_form("step")

    def prefill(self, state, q_BTHD, k_BTHD, v_BTHM, *, key_lengths=None):
        """A block of T tokens of causal self-attention in parallel form, continuing from `state`
        (from `init_state`, `step` or an earlier `prefill`): -> (state, out [B, T, H, M]).

        Equal to T calls of `step` (up to rounding), and the returned state is the one they
        would leave. `key_lengths` int [B]: tokens at index >= key_lengths[b] are padding that
        changes neither the state nor the outputs at valid positions (kinds that support it).
        Inference only: dropout must be off (`model.eval()`).
        """
        raise self._no_recurrent_form("prefill")

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """Precompute what cross-attention over a fixed memory needs, once per sequence."""
        raise self._no_memory_form("init_memory")

    def attend_memory(self, memory, q):
        """Cross-attention over the memory from `init_memory`: one query step q [B, H, D] ->
        [B, H, M], or a block q [B, T, H, D] -> [B, T, H, M]."""
        raise self._no_memory_form("attend_memory")

    def _no_memory_form(self, what: str) -> ValueError:
        return ValueError(
            f"attention kind {self.kind!r} cannot attend over a fixed memory "
            f"({what}); use 'softmax', 'linear' or 'linformer' for cross-attention."
        )

    def _no_recurrent_form(self, what: str) -> ValueError:
        return ValueError(
            f"attention kind {self.kind!r} has no recurrent form ({what}): "
            f"{self.no_recurrent_form_reason}. Kinds with one: "
            f"{[k for k in registered_attention_kinds() if _KINDS[k].has_recurrent_form]}."
        )

    def _require_causal(self, what: str):
        if not self.causal:
            raise ValueError(
                f"{what} is the recurrent form of causal self-attention, but this "
                f"{self.kind!r} attention is non-causal; build it with causal=True."
            )

    def _check_prefill(self, state, q_BTHD, k_BTHD, v_BTHM):
        self._require_causal("prefill")
        check_inference_mode(self)
        ops._checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=f"{self.kind} prefill")
        if q_BTHD.shape[1] != k_BTHD.shape[1]:
            raise ValueError(
                f"{self.kind} prefill: a block of causal self-attention needs as "
                f"many queries as keys, got T={q_BTHD.shape[1]} and "
                f"S={k_BTHD.shape[1]}."
            )


def _memory_queries(q, name: str):
    """q [B, H, D] (one step) or [B, T, H, D] (a block) -> ([B, T, H, D], whether one step)."""
    if q.ndim not in (3, 4):
        raise ValueError(
            f"{name}: queries must be [batch, heads, features] (one step) or "
            f"[batch, time, heads, features] (a block), got shape "
            f"{tuple(q.shape)}."
        )
    return (q[:, None], True) if q.ndim == 3 else (q, False)


def _softmax_over_memory(q, k_BSHD, v_BSHM, *, key_lengths=None, scale=None, name):
    """Queries [B, H, D] or [B, T, H, D] over fixed keys/values (cross-attention memories)."""
    q_BTHD, one_step = _memory_queries(q, name)
    out_BTHM = ops.softmax_attention_reference(q_BTHD, k_BSHD, v_BSHM, key_lengths=key_lengths, scale=scale)
    return out_BTHM[:, 0] if one_step else out_BTHM


class SoftmaxMemory(NamedTuple):
    k_BSHD: jax.Array
    v_BSHM: jax.Array
    key_lengths: jax.Array | None


@dataclasses.dataclass(frozen=True)
class SoftmaxOptions:
    """Options of `"softmax"` attention.

    Attributes:
      softmax_temp: logit scale, default 1/sqrt(head_dim).
      attention_dropout: dropout on the attention probabilities while training, in [0, 1).
      implementation: passed to `ops.softmax_attention` (None, "xla", "cudnn", "reference").
      sow_weights: record the probabilities [B, H, T, S] as `nnx.Intermediate`
        "attention_weights" (read them with `nnx.capture`); uses the explicit-weights path.
    """

    softmax_temp: float | None = None
    attention_dropout: float = 0.0
    implementation: str | None = None
    sow_weights: bool = False

    def __post_init__(self):
        if self.implementation not in ops.softmax.IMPLEMENTATIONS:
            raise ValueError(
                f"softmax attention: unknown implementation {self.implementation!r}; "
                f"expected one of {ops.softmax.IMPLEMENTATIONS}."
            )
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}.")


@register_attention("softmax")
class SoftmaxAttention(AttentionCore):
    """softmax(q k^T * softmax_temp) v; recurrent form with a preallocated KV cache.

    Options: `SoftmaxOptions`.

    With `sequence_axis` each device keeps its queries and all-gathers the keys and values
    (`ops.softmax_attention`); the explicit-weights path (sow_weights, attention dropout while
    training) has no sequence-parallel form and is refused.
    """

    options_class = SoftmaxOptions
    has_recurrent_form = True
    has_sequence_parallel_form = True

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(rngs=rngs, **kwargs)
        options = self.options
        if options.sow_weights and self.sequence_axis is not None:
            raise ValueError(
                f"softmax attention: sow_weights records the whole [B, H, T, S] "
                f"matrix, which sequence_axis={self.sequence_axis!r} never forms; use "
                f"one or the other."
            )
        self.softmax_temp = options.softmax_temp
        self.implementation = options.implementation
        self.sow_weights = options.sow_weights
        self.attention_dropout = nnx.Dropout(options.attention_dropout, rngs=rngs)

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        dropout_active = self.attention_dropout.rate > 0 and not self.attention_dropout.deterministic
        if not (self.sow_weights or dropout_active):
            return ops.softmax_attention(
                q_BTHD,
                k_BSHD,
                v_BSHM,
                causal=self.causal,
                key_lengths=key_lengths,
                mask=mask,
                scale=self.softmax_temp,
                implementation=self.implementation,
                sequence_axis=self.sequence_axis,
            )
        if self.sequence_axis is not None:
            raise ValueError(
                f"softmax attention: attention dropout drops entries of the whole "
                f"[B, H, T, S] matrix, which sequence_axis={self.sequence_axis!r} "
                f"never forms; train with attention_dropout=0 or without a "
                f"sequence axis."
            )
        key_lengths = ops.softmax.validate_softmax_inputs(
            q_BTHD, k_BSHD, v_BSHM, causal=self.causal, key_lengths=key_lengths
        )
        w_BHTS = ops.softmax_attention_weights(
            q_BTHD, k_BSHD, causal=self.causal, key_lengths=key_lengths, mask=mask, scale=self.softmax_temp
        )
        if self.sow_weights:
            self.sow(nnx.Intermediate, "attention_weights", w_BHTS)
        w_BHTS = self.attention_dropout(w_BHTS)
        out_BTHM = jnp.einsum("bhts,bshm->bthm", w_BHTS, v_BSHM.astype(w_BHTS.dtype))
        return out_BTHM.astype(v_BSHM.dtype)

    def init_state(self, batch, max_length, dtype=jnp.float32):
        """A preallocated KV cache of `max_length` slots."""
        self._require_causal("init_state")
        if max_length is None:
            raise ValueError(
                "softmax attention keeps a KV cache and needs max_length, the number of steps to allocate."
            )
        return ops.init_kv_cache(batch, max_length, self.num_heads, self.head_dim, self.value_dim, dtype)

    def step(self, state, q_BHD, k_BHD, v_BHM):
        """Append k_t, v_t to the cache and attend over the filled slots."""
        self._require_causal("step")
        return ops.softmax_attention_step(state, q_BHD, k_BHD, v_BHM, scale=self.softmax_temp)

    def prefill(self, state, q_BTHD, k_BTHD, v_BTHM, *, key_lengths=None):
        """Write the block into cache slots [length, length + T) and attend causally over the
        filled slots (`ops.softmax_attention_prefill`).

        The cache keeps one length for the whole batch, so per-example `key_lengths` cannot be
        honoured: prefill the common prefix and `step` the rest, or use a linear kind. The block
        runs in the global view whatever `sequence_axis` is.
        """
        self._check_prefill(state, q_BTHD, k_BTHD, v_BTHM)
        if key_lengths is not None:
            raise ValueError(
                "softmax prefill: the KV cache keeps one length for the whole batch, "
                "so per-example key_lengths cannot be honoured; prefill the prefix "
                "every example shares and step the rest, or use a linear kind."
            )
        return ops.softmax_attention_prefill(state, q_BTHD, k_BTHD, v_BTHM, scale=self.softmax_temp)

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """The memory's projected keys and values, kept whole."""
        return SoftmaxMemory(k_BSHD, v_BSHM, key_lengths)

    def attend_memory(self, memory, q):
        """Softmax over all valid memory keys for one query step q [B, H, D] or a block
        q [B, T, H, D]."""
        return _softmax_over_memory(
            q,
            memory.k_BSHD,
            memory.v_BSHM,
            key_lengths=memory.key_lengths,
            scale=self.softmax_temp,
            name="softmax attend_memory",
        )


class FeatureProjection(nnx.Variable):
    """A fixed random matrix of a feature map (FAVOR+): state, not a trained parameter."""


@dataclasses.dataclass(frozen=True)
class LinearOptions:
    """Options of `"linear"` and `"causal-linear"` attention.

    Attributes:
      feature_map: "elu" (default), "relu", "favor" (FAVOR+, a random matrix drawn from the
        layer's `params` RNG stream and kept fixed until `redraw_features`), another name from
        `ops.registered_feature_maps()`, or a callable.
      num_features: F for "favor" (default head_dim); other feature maps do not take it.
      impl: causal implementation, one of `ops.IMPLS` (default "chunked").
      chunk_size: chunk length for impl="chunked" (None: `ops.default_chunk_size`).
      eps: added to the normaliser.
    """

    feature_map: str | Callable = "elu"
    num_features: int | None = None
    impl: str = "chunked"
    chunk_size: int | None = None
    eps: float = 1e-6

    def __post_init__(self):
        if self.impl not in ops.IMPLS:
            raise ValueError(f"linear attention: unknown impl {self.impl!r}; expected one of {ops.IMPLS}.")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size < 1):
            raise ValueError(
                f"linear attention: chunk_size must be None or an integer >= 1, got {self.chunk_size!r}."
            )
        if self.feature_map == "favor":
            if self.num_features is not None and (
                not isinstance(self.num_features, int) or self.num_features < 1
            ):
                raise ValueError(
                    f"linear attention: num_features must be None or an integer >= 1, got "
                    f"{self.num_features!r}."
                )
        else:
            if self.num_features is not None:
                raise ValueError(
                    f"num_features is the size of FAVOR+ random features; feature "
                    f"map {self.feature_map!r} does not take it."
                )
            ops.make_feature_map(self.feature_map)  # An unknown name fails here, where it is given.


@register_attention("linear")
class LinearAttention(AttentionCore):
    """Linear attention phi(q) (sum phi(k) v^T) / (phi(q) . sum phi(k) + eps).

    Non-causal, or causal when the layer is causal (a decoder's self-attention); its recurrent
    state is `ops.LinearState` (S, z), constant in size whatever the length.

    Options: `LinearOptions`.

    Arbitrary [T, S] masks cannot be honoured without the T x S matrix; key_lengths is the
    supported padding mask. In causal form right-padded keys never reach a valid position; they
    are dropped anyway, so padded positions attend to the valid keys only, as in the authors'
    layer.

    With `sequence_axis` each device reduces its block to an (S, z) state: the causal form
    combines them by an exclusive prefix over devices (LASP-2), the non-causal one by a sum.
    """

    options_class = LinearOptions
    has_recurrent_form = True
    has_sequence_parallel_form = True

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(rngs=rngs, **kwargs)
        options = self.options
        self.impl = options.impl
        self.chunk_size = options.chunk_size
        self.eps = options.eps
        self.feature_map_spec = options.feature_map
        if options.feature_map == "favor":
            self.feature_projection = FeatureProjection(
                ops.favor_projection(rngs.params(), options.num_features or self.head_dim, self.head_dim)
            )

    def redraw_features(self, key):
        """Draw a new FAVOR+ random matrix (no-op error for deterministic feature maps)."""
        if self.feature_map_spec != "favor":
            raise ValueError(f"feature map {self.feature_map_spec!r} has no random features.")
        f, d = self.feature_projection[...].shape
        self.feature_projection.set_value(ops.favor_projection(key, f, d))

    @property
    def feature_map(self) -> ops.FeatureMap:
        if self.feature_map_spec == "favor":
            return ops.FavorFeatureMap(self.feature_projection[...])
        return ops.make_feature_map(self.feature_map_spec)

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        if mask is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot honour an arbitrary [T, S] mask (that needs the "
                "T x S matrix linear attention avoids); use key_lengths for padding and "
                "causal=True for causality, or kind='softmax'."
            )
        if self.causal:
            return ops.causal_linear_attention(
                q_BTHD,
                k_BSHD,
                v_BSHM,
                feature_map=self.feature_map,
                impl=self.impl,
                chunk_size=self.chunk_size,
                eps=self.eps,
                key_lengths=key_lengths,
                sequence_axis=self.sequence_axis,
            )
        return ops.linear_attention(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            feature_map=self.feature_map,
            key_lengths=key_lengths,
            eps=self.eps,
            sequence_axis=self.sequence_axis,
        )

    def init_state(self, batch, max_length=None, dtype=jnp.float32):
        """(S, z) zeros; `max_length` is accepted for a uniform interface and not needed."""
        self._require_causal("init_state")
        f = self.feature_map.num_features(self.head_dim)
        return ops.init_linear_state(
            batch, self.num_heads, f, self.value_dim, jnp.promote_types(dtype, jnp.float32)
        )

    def step(self, state, q_BHD, k_BHD, v_BHM):
        """S += phi(k_t) v_t^T, z += phi(k_t); out_t = phi(q_t)^T S / phi(q_t)^T z."""
        self._require_causal("step")
        return ops.linear_attention_step(
            state, q_BHD, k_BHD, v_BHM, feature_map=self.feature_map, eps=self.eps
        )

    def prefill(self, state, q_BTHD, k_BTHD, v_BTHM, *, key_lengths=None):
        """The causal parallel form (this layer's impl) started from the state (S, z) and
        returning the state after the block (`ops.causal_linear_attention(initial_state=,
        return_state=True)`); with key_lengths, the state after each example's real tokens.

        With `sequence_axis`, the block is split over the devices when a mesh with that axis is
        set and T divides over it; otherwise it runs on the arrays as they are (same result).
        """
        self._check_prefill(state, q_BTHD, k_BTHD, v_BTHM)
        out_BTHM, new_state = ops.causal_linear_attention(
            q_BTHD,
            k_BTHD,
            v_BTHM,
            feature_map=self.feature_map,
            impl=self.impl,
            chunk_size=self.chunk_size,
            eps=self.eps,
            initial_state=state,
            return_state=True,
            key_lengths=key_lengths,
            sequence_axis=_prefill_axis(self.sequence_axis, q_BTHD.shape[1]),
        )
        # The state keeps its dtypes, as `step` keeps them, so it stays a valid scan carry.
        new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)
        return new_state, out_BTHM

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """Reduce the memory to one (S, z) summary: O(D*M) per head whatever its length.

        With `sequence_axis`, summed over the devices when a mesh with that axis is set and S
        divides over it (as the parallel form); otherwise on the arrays as they are.
        """
        return ops.linear_state_from_keys(
            k_BSHD,
            v_BSHM,
            feature_map=self.feature_map,
            key_lengths=key_lengths,
            sequence_axis=_prefill_axis(self.sequence_axis, k_BSHD.shape[1]),
        )

    def attend_memory(self, memory, q):
        """Read one query step q [B, H, D], or a block q [B, T, H, D], out of the (S, z)
        summary."""
        _memory_queries(q, "linear attend_memory")
        return ops.linear_attention_from_state(memory, q, feature_map=self.feature_map, eps=self.eps)


@register_attention("causal-linear")
class CausalLinearAttention(LinearAttention):
    """`"linear"` that insists on the causal form (the authors' name for it); the same options,
    `LinearOptions`."""

    def __init__(self, *, causal: bool, rngs: nnx.Rngs, **kwargs):
        if not causal:
            raise ValueError(
                "attention kind 'causal-linear' is causal by definition but was "
                "built for non-causal attention (an encoder or cross-attention); "
                "use kind='linear' there."
            )
        super().__init__(causal=causal, rngs=rngs, **kwargs)


class HashRotations(nnx.Variable):
    """The fixed random rotations of LSH attention: state, not a trained parameter."""


@dataclasses.dataclass(frozen=True)
class ReformerOptions:
    """Options of `"reformer"` attention (checked by `ops.check_lsh_options`).

    Attributes:
      num_buckets: U, 1 or even (default 8).
      num_rounds: R hashing rounds (default 4; the paper compares 1, 4 and 8).
      chunk_size: C, each query sees its chunk and the previous one in sorted order (default 32).
      softmax_temp: logit scale, default 1/sqrt(head_dim).
    """

    num_buckets: int = 8
    num_rounds: int = 4
    chunk_size: int = 32
    softmax_temp: float | None = None

    def __post_init__(self):
        ops.check_lsh_options(
            num_rounds=self.num_rounds, num_buckets=self.num_buckets, chunk_size=self.chunk_size
        )


@register_attention("reformer")
class ReformerAttention(AttentionCore):
    """Reformer's LSH attention, the paper's baseline (see `ops.lsh` for the exact definition).

    Queries and keys are shared: the keys are the unit-normalised queries, so this kind is
    self-attention only and `MultiHeadAttention` builds no key projection for it. Causal or not;
    key_lengths padding is honoured; arbitrary masks are not.

    Options: `ReformerOptions`.

    The rotations are drawn once from the `params` RNG stream and kept (so evaluation is
    deterministic); `redraw_hashes(key)` draws new ones.
    """

    options_class = ReformerOptions
    shares_query_key = True
    no_recurrent_form_reason = (
        "which keys share a chunk depends on the hash-sorted order of the "
        "whole sequence, so no per-token state reproduces the parallel form"
    )

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        # No sequence-parallel form (the hash-sorted chunks span the whole sequence): the base
        # class rejects a sequence_axis with the list of kinds that have one.
        super().__init__(rngs=rngs, **kwargs)
        options = self.options
        self.chunk_size = options.chunk_size
        self.softmax_temp = options.softmax_temp
        self.rotations = HashRotations(
            ops.lsh_rotations(rngs.params(), options.num_rounds, self.head_dim, options.num_buckets)
        )

    def redraw_hashes(self, key):
        """Draw new random rotations (same rounds and buckets)."""
        R, D, half = self.rotations[...].shape
        self.rotations.set_value(ops.lsh_rotations(key, R, D, max(1, 2 * half)))

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        if mask is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot honour an arbitrary [T, S] mask; use "
                "key_lengths for padding and causal=True for causality."
            )
        if k_BSHD is not q_BTHD:
            raise ValueError(
                f"{self.kind!r} attention shares queries and keys (its keys are the "
                "normalised queries), so it takes k=q: self-attention only. Use "
                "another kind for cross-attention."
            )
        return ops.lsh_attention(
            q_BTHD,
            v_BSHM,
            self.rotations[...],
            chunk_size=self.chunk_size,
            causal=self.causal,
            key_lengths=key_lengths,
            scale=self.softmax_temp,
        )


class LinformerMemory(NamedTuple):
    k_BKHD: jax.Array
    v_BKHM: jax.Array


def _linformer_size_error(name: str, value) -> ValueError:
    return ValueError(
        f"linformer attention: {name} must be an integer >= 1, got {value!r}"
        + (" (it is required: the most keys the layer accepts)" if name == "max_length" else "")
        + "."
    )


@dataclasses.dataclass(frozen=True)
class LinformerOptions:
    """Options of `"linformer"` attention.

    Attributes:
      max_length: L, the most keys the layer accepts; shorter inputs are padded. Required to
        build the layer; None here means not given yet (a trainer may fill it in from its
        data), so a config without it is valid until a layer is built from it.
      projected_length: K rows (default 64).
      share_kv: one projection for keys and values (the paper's "shared" variant).
      softmax_temp: logit scale, default 1/sqrt(head_dim).
    """

    max_length: int | None = None
    projected_length: int = 64
    share_kv: bool = False
    softmax_temp: float | None = None

    def __post_init__(self):
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise _linformer_size_error("max_length", self.max_length)
        if not isinstance(self.projected_length, int) or self.projected_length < 1:
            raise _linformer_size_error("projected_length", self.projected_length)


@register_attention("linformer")
class LinformerAttention(AttentionCore):
    """Linformer: keys and values projected along time to `projected_length` rows (see
    `ops.linformer`). Non-causal only (an encoder, or cross-attention).

    Options: `LinformerOptions` (`max_length` required).

    As cross-attention it has a memory form: the memory is reduced once to its K projected
    keys and values (`init_memory`), queried per decoding step (`attend_memory`).
    """

    options_class = LinformerOptions
    no_recurrent_form_reason = "it is non-causal: every projected row mixes every position"

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        # No sequence-parallel form (not implemented): the base class rejects a sequence_axis.
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        options = self.options
        if self.causal:
            raise ValueError(
                "attention kind 'linformer' has no causal form (each projected row "
                "mixes every position, future ones included); use it in an encoder "
                "or for cross-attention, and 'linear' or 'softmax' for causal "
                "self-attention."
            )
        if options.max_length is None:
            raise _linformer_size_error("max_length", None)
        # fan-in L: a projected row keeps the scale of one key.
        init = nnx.initializers.lecun_normal()
        shape = (options.max_length, options.projected_length)
        self.key_projection = nnx.Param(init(rngs.params(), shape, param_dtype))
        self.value_projection = (
            None if options.share_kv else nnx.Param(init(rngs.params(), shape, param_dtype))
        )
        self.softmax_temp = options.softmax_temp

    def _projections(self):
        # The ops cast them to the keys' dtype and accumulate in float32.
        e_LJ = self.key_projection[...]
        return e_LJ, (e_LJ if self.value_projection is None else self.value_projection[...])

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        if mask is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot honour an arbitrary [T, S] mask (its "
                "keys are mixtures of positions); use key_lengths for padding."
            )
        return ops.linformer_attention(
            q_BTHD, k_BSHD, v_BSHM, *self._projections(), key_lengths=key_lengths, scale=self.softmax_temp
        )

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """The memory's K projected keys and values, computed once."""
        return LinformerMemory(
            *ops.linformer_project(k_BSHD, v_BSHM, *self._projections(), key_lengths=key_lengths)
        )

    def attend_memory(self, memory, q):
        """Softmax of one query step q [B, H, D], or a block q [B, T, H, D], over the K
        projected rows."""
        out = _softmax_over_memory(
            q.astype(memory.k_BKHD.dtype),
            memory.k_BKHD,
            memory.v_BKHM,
            scale=self.softmax_temp,
            name="linformer attend_memory",
        )
        return out.astype(q.dtype)
