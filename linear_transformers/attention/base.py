"""The attention-core interface and the registry of attention kinds.

Legend: B batch, T query time, S key time, H heads, D key/query features per head, M value
features per head.

A core is the attention after the projections, chosen by name (`registered_attention_kinds()`);
`MultiHeadAttention` owns the projections and builds its core with `make_attention_core`, the one
way to build one. A core has one parallel form for training and, where the kind allows, a
recurrent form and a memory form:

  core(q_BTHD, k_BSHD, v_BSHM, key_lengths=, mask=)     parallel -> out [B, T, H, M]
  core.init_state(batch, max_length=, dtype=)          causal self-attention state
  core.step(state, q_BHD, k_BHD, v_BHM)                -> (state, out_BHM), one token
  core.prefill(state, q_BTHD, k_BTHD, v_BTHM)          -> (state, out_BTHM), a block of T tokens
                                                       in parallel form, from and to a state
  core.init_memory(k_BSHD, v_BSHM, key_lengths)        cross-attention over a fixed memory,
  core.attend_memory(memory, q_BHD or q_BTHD)          computed once, queried per step or block

`prefill` equals T calls of `step` and leaves the same state, so a prompt is read in one
parallel pass and decoding goes on token by token (or block by block: streaming).

The order of a state and an output, at every level of the library:
- a function that takes a state first returns it first: `step(state, ...)` and
  `prefill(state, ...)` return `(state, out)` (the ops' `*_step` and `*_prefill` functions,
  cores, layers, stacks, models), so each is a `lax.scan` body `(carry, x) -> (carry, y)`;
- a parallel op whose state is optional (`initial_state=`, `return_state=True`) returns `out`,
  and `(out, state)` when asked for the state: the optional output is appended, as FLA's
  `output_final_state` does.
No code turns one pair into the other by hand: each level calls the form with its own order.

Every stateful module has `init_state(batch, *, max_length=None, dtype=None)`; the extras
are keyword-only and named the same everywhere (`memory=`, `memory_lengths=` for a decoder).

Sequence parallelism: a kind with `has_sequence_parallel_form` built with `sequence_axis="name"`
runs its parallel form with the time axis split over mesh axis `name` (the ops wrap themselves
in `jax.shard_map` under `jax.set_mesh(mesh)`; model code stays in the global view).

Options: each kind declares them as one frozen dataclass, its `options_class`: the fields are
the options a config may set, with their defaults, and `__post_init__` rejects unusable values.
`check_attention_options(kind, mapping)` builds it, so the options are validated once, where
they are given; the core receives the instance as `options=`. An options class may name the old
spellings of its options in `renamed_options` ({old: new}), which the mapping may still use, with
a DeprecationWarning, for one release.

New kinds subclass `AttentionCore` in a file of their own, set `options_class` to a frozen
dataclass of their options (a kind that sets none inherits `NoOptions` and takes no options),
and register with `@register_attention("name")`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_transformers import _deprecation, ops

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
    for old, new in getattr(options_class, "renamed_options", {}).items():
        if old in options:
            options = _deprecation.rename_key(options, old, new, where=f"attention kind {kind!r} options")
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


def kinds_with(flag: str) -> list[str]:
    """Registered kinds whose class sets `flag` (e.g. "has_recurrent_form"), sorted."""
    return [k for k in registered_attention_kinds() if getattr(_KINDS[k], flag)]


def sequence_parallel_kinds() -> list[str]:
    """Registered kinds with a sequence-parallel form (`has_sequence_parallel_form`), sorted."""
    return kinds_with("has_sequence_parallel_form")


def check_sequence_axis(kind: str, sequence_axis) -> None:
    """Raise a ValueError unless `sequence_axis` is None, or a mesh axis name and attention
    `kind` has a sequence-parallel form."""
    _check_sequence_axis(attention_class(kind), sequence_axis)


def _check_sequence_axis(cls: type["AttentionCore"], sequence_axis) -> None:
    if sequence_axis is None:
        return
    if not isinstance(sequence_axis, str) or not sequence_axis:
        raise ValueError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}.")
    if not cls.has_sequence_parallel_form:
        raise ValueError(
            f"attention kind {cls.kind!r} has no sequence-parallel form, so it cannot "
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
    in_features: int | None = None,
    dtype=None,
    param_dtype=jnp.float32,
    options: Mapping[str, Any] | Any | None = None,
) -> "AttentionCore":
    """Build the registered core `kind`: the one way to build a core (`MultiHeadAttention`
    builds its own with it).

    `options` is a mapping {option: value}, an instance of the kind's `options_class`, or None
    (the defaults); it is validated once, by building that class (an unknown option is a
    ValueError listing the kind's options), and the core receives the instance. `sequence_axis`
    (a mesh axis name) is refused by kinds without a sequence-parallel form; `in_features` (the
    layer's input width), `dtype` and `param_dtype` (computation and storage) serve kinds with
    parameters of their own.
    """
    return attention_class(kind)(
        causal=causal,
        num_heads=num_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        rngs=rngs,
        sequence_axis=sequence_axis,
        in_features=in_features,
        dtype=dtype,
        param_dtype=param_dtype,
        options=check_attention_options(kind, {} if options is None else options),
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


def prefill_axis(axis: str | None, length: int) -> str | None:
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


def memory_queries(q, name: str):
    """q [B, H, D] (one step) or [B, T, H, D] (a block) -> ([B, T, H, D], whether one step)."""
    if q.ndim not in (3, 4):
        raise ValueError(
            f"{name}: queries must be [batch, heads, features] (one step) or "
            f"[batch, time, heads, features] (a block), got shape "
            f"{tuple(q.shape)}."
        )
    return (q[:, None], True) if q.ndim == 3 else (q, False)


def keyword_state_arguments(init_state):
    """Decorator of an `init_state(self, batch, *, ...)`: one positional argument (the batch
    size, an int >= 1), the rest keywords. Another positional argument, or a batch that is not
    an int (an array where a decoder's memory was once passed first), is a TypeError that
    names the keyword form instead of Python's bare count of arguments."""
    keywords = [p.name for p in inspect.signature(init_state).parameters.values() if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(init_state)
    def checked(self, *args, **kwargs):
        if not args and "batch" in kwargs:
            args = (kwargs.pop("batch"),)
        where = f"{type(self).__name__}.init_state"
        form = f"{where}(batch, {', '.join(k + '=...' for k in keywords)})"
        if len(args) != 1:
            raise TypeError(
                f"{where} takes the batch size as its only positional argument and the rest as "
                f"keywords: {form}; got {len(args)} positional arguments."
            )
        batch = args[0]
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            got = f"an array of shape {tuple(batch.shape)}" if hasattr(batch, "shape") else repr(batch)
            raise TypeError(f"{where}: batch must be an int >= 1, got {got}; call {form}.")
        return init_state(self, int(batch), **kwargs)

    return checked


def integer_option(options, name: str, *, where: str, allow_none: bool = False, note: str = ""):
    """In an options class's `__post_init__`: check the integer field `name` of the frozen
    `options` (`ops.input_checks.check_int`: a numpy integer is accepted and stored as an int; a
    bool or a float is a ValueError naming the option)."""
    value = ops.input_checks.check_int(
        getattr(options, name), f"{where}: {name}", allow_none=allow_none, note=note
    )
    object.__setattr__(options, name, value)


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a kind that takes none: `AttentionCore.options_class` by default."""


@dataclasses.dataclass(frozen=True)
class CausalFormOptions:
    """The options of the kinds computed by the causal linear ops (`ops.causal_linear_attention`,
    `ops.gated_linear_attention`): which form computes the parallel pass. `LinearOptions` and
    `GatedOptions` extend it.

    Attributes:
      implementation: one of `ops.LINEAR_IMPLEMENTATIONS` (default "chunked"); all give the
        same result.
      chunk_size: chunk length for implementation="chunked" (None: `ops.DEFAULT_CHUNK_SIZE`)
        or "pallas" (a power of two >= 16).
    """

    # Old option names, accepted by `check_attention_options` with a DeprecationWarning.
    renamed_options: ClassVar[Mapping[str, str]] = {"impl": "implementation"}

    implementation: str = "chunked"
    chunk_size: int | None = None

    def __post_init__(self):
        where = type(self).__name__
        implementation = _deprecation.renamed_value(
            self.implementation, "quadratic", "reference", what="implementation", where=where
        )
        if implementation not in ops.LINEAR_IMPLEMENTATIONS:
            raise ValueError(
                f"{where}: unknown implementation {implementation!r}; expected one of "
                f"{ops.LINEAR_IMPLEMENTATIONS}."
            )
        object.__setattr__(self, "implementation", implementation)
        integer_option(self, "chunk_size", where=where, allow_none=True)

    def op_kwargs(self, feature_map, *, causal_form: bool = True) -> dict:
        """The keyword arguments of the ops for these options and the layer's `feature_map` (an
        option FAVOR+ turns into the layer's own random matrix): with `causal_form`, those of the
        causal parallel form (implementation, chunk_size) too. Every call of an op builds its
        keywords here."""
        kwargs = {"feature_map": feature_map}
        if causal_form:
            kwargs.update(implementation=self.implementation, chunk_size=self.chunk_size)
        return kwargs


class AttentionCore(nnx.Module):
    """Attention after the projections: [B, T, H, D] queries to [B, T, H, M] outputs.

    A core is built as `cls(causal=, num_heads=, head_dim=, value_dim=, rngs=, sequence_axis=,
    in_features=, dtype=, param_dtype=, options=)`, where `options` is an instance of the kind's
    `options_class` (None: its defaults); `make_attention_core` builds that instance from a
    mapping. The core keeps it as `self.options`; `in_features` (the width of the layer's
    input), `dtype` (computation) and `param_dtype` (storage) serve kinds with parameters of
    their own (they read them in their constructor).

    Return order (the rule of the whole library): `step(state, ...)` and `prefill(state, ...)`
    return `(state, out)`; the parallel call returns `out`.

    Masked rows (the rule of every kind and form): a query that sees no key -- every key masked
    by `mask`, `key_lengths` 0, a padding query (segment id 0, never a key) or a query whose
    segment has no key -- gives an output of 0, with finite gradients.

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
      supports_segments: the parallel form (and `prefill`) take `segment_ids=` (packed
        sequences; and `key_segment_ids=` for cross-attention where the kind can).
      takes_inputs: the kind computes gates from the layer's input (decays, an output gate):
        `MultiHeadAttention` passes it as `x=` to the parallel form, `step` and `prefill`, with
        `positions=` to the parallel form and `prefill`.
      no_recurrent_form_reason: why a kind has none, for the error message.
    """

    kind = "abstract"
    options_class: type = NoOptions
    has_recurrent_form = False
    has_sequence_parallel_form = False
    shares_query_key = False
    supports_segments = False
    takes_inputs = False
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
        in_features: int | None = None,
        dtype=None,
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
        self.in_features = in_features
        self.dtype = dtype

    def _check_causal_with_inputs(self, *, along_time: str, from_input: str):
        """For a causal self-attention kind that reads the layer input: refuse a non-causal
        build and one without in_features. `along_time`: what runs along time ("its decay");
        `from_input`: what it computes from the input ("gates")."""
        if not self.causal:
            raise ValueError(
                f"attention kind {self.kind!r} is causal by definition ({along_time} runs along "
                f"time) but was built for non-causal attention (an encoder or cross-attention); "
                f"use 'linear' or 'softmax' there."
            )
        if self.in_features is None:
            raise ValueError(
                f"attention kind {self.kind!r} computes {from_input} from the layer input and "
                f"needs in_features, its width (MultiHeadAttention passes it)."
            )

    def _require_inputs(self, x, what: str):
        """x, or a ValueError naming `what` (a form of a `takes_inputs` kind) needed it."""
        if x is None:
            raise ValueError(
                f"{self.kind!r} attention computes its gates from the layer input: {what} needs "
                f"x= (MultiHeadAttention passes it)."
            )
        return x

    def _refuse_pair_masks(self, mask, key_segment_ids):
        """Causal self-attention kinds take padding and packing as key_lengths and segment_ids."""
        if mask is not None or key_segment_ids is not None:
            raise ValueError(
                f"{self.kind!r} attention takes no [T, S] mask and no key_segment_ids (causal "
                f"self-attention only); use key_lengths for padding and segment_ids for packed "
                f"sequences."
            )

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        """Parallel form: [B, T, H, D] queries over [B, S, H, *] keys/values -> [B, T, H, M]."""
        raise NotImplementedError(f"attention kind {self.kind!r} defines no parallel form.")

    def init_state(self, batch: int, *, max_length: int | None = None, dtype=None):
        """Empty recurrent state for causal self-attention (`max_length` steps at most; kinds
        whose state grows need it). `dtype`: of a state that holds keys and values (a KV cache;
        None: float32); running sums are float32 at least whatever it is."""
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
        Kinds with `supports_segments` also take `segment_ids=` [B, T]: a packed block whose
        first segment continues the state and whose later segments start afresh; decoding then
        continues its last segment. Inference only: dropout must be off (`model.eval()`).
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
            f"{self.no_recurrent_form_reason}. Kinds with one: {kinds_with('has_recurrent_form')}."
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
        ops.input_checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=f"{self.kind} prefill")
        if q_BTHD.shape[1] != k_BTHD.shape[1]:
            raise ValueError(
                f"{self.kind} prefill: a block of causal self-attention needs as "
                f"many queries as keys, got T={q_BTHD.shape[1]} and "
                f"S={k_BTHD.shape[1]}."
            )
