"""Feature maps phi for kernelised (linear) attention, and their registry.

Linear attention replaces exp(q.k) by phi(q).phi(k) with phi >= 0. A feature map takes
x[..., D] to phi(x)[..., F]. Queries and keys may be mapped differently where a per-query
constant cancels between numerator and denominator (the FAVOR+ stabiliser).

Legend: D key/query features, F feature-map features; `...` any leading shape.

Feature maps are named in ops and layers by a string from the registry (`"elu"`, `"relu"`,
`"favor"`, `"identity"`), by a `FeatureMap` instance, or by any callable `x -> phi(x)`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp


class FeatureMap:
    """A non-negative feature map phi: [..., D] -> [..., F].

    Subclasses implement `__call__` (used for keys) and may override `query` where a
    per-query positive factor cancels in the attention normaliser.
    """

    # True where phi(x)[..., i] is a function of x[..., i] alone, the same for queries and keys
    # (F = D): a kernel may then apply it to any block of its inputs (`gated_linear/pallas.py`).
    pointwise = False

    def __call__(self, x):
        raise NotImplementedError

    def query(self, x):
        """phi for queries; may differ from `key` by a per-query factor that cancels."""
        return self(x)

    def key(self, x):
        """phi for keys."""
        return self(x)

    def num_features(self, head_dim: int) -> int:
        """F for inputs with D = head_dim features: D for a pointwise map, else found by shape
        evaluation (a trace, no compute)."""
        if self.pointwise:
            return head_dim
        out = jax.eval_shape(self, jax.ShapeDtypeStruct((1, head_dim), jnp.float32))
        return out.shape[-1]


class CallableFeatureMap(FeatureMap):
    """Wraps a plain function `x[..., D] -> phi[..., F]`, the same for queries and keys."""

    def __init__(self, fn: Callable, name: str, *, pointwise: bool = False):
        self._fn = fn
        self._name = name
        self.pointwise = pointwise

    def __call__(self, x):
        return self._fn(x)

    def __repr__(self):
        return f"CallableFeatureMap({self._name})"

    # Equal when they wrap the same function alike: layers built from one config then share a
    # static structure, which stacking them needs (`layer_stack.stack`), as jit's cache does.
    def _key(self):
        return self._fn, self._name, self.pointwise

    def __eq__(self, other):
        return isinstance(other, CallableFeatureMap) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def elu_plus_one(x):
    """elu(x) + 1, written as where(x > 0, x + 1, exp(x)).

    The textbook `elu(x) + 1` computes exp(x) - 1 + 1, which rounds to exactly 0 in bfloat16 for
    x < -6 or so; this form is exact and strictly positive in every dtype, and `minimum` keeps the
    unselected branch finite so the gradient has no inf * 0.
    """
    return jnp.where(x > 0, x + 1, jnp.exp(jnp.minimum(x, 0)))


class FavorFeatureMap(FeatureMap):
    """FAVOR+ positive random features (Choromanski et al., Performer).

    phi(x) = exp(w_f . x' - |x'|^2 / 2) / sqrt(F) with x' = x / D^(1/4), so that
    E[phi(q) . phi(k)] = exp(q . k / sqrt(D)), the softmax kernel.

    The random matrix `projection_FD` is passed in explicitly (see `favor_projection`), so the
    same features are used at every call until the caller redraws them. Queries are stabilised by
    subtracting their own maximum exponent, a per-query factor that cancels in the normaliser. Keys
    need no stabiliser: w.x' - |x'|^2/2 <= |w|^2/2, so key features are bounded whatever x is.
    """

    def __init__(self, projection_FD):
        if projection_FD.ndim != 2:
            raise ValueError(
                f"FAVOR+ projection must be a [num_features, head_dim] matrix, got shape "
                f"{tuple(projection_FD.shape)}."
            )
        self.projection_FD = projection_FD

    def num_features(self, head_dim: int) -> int:
        """F, the projection's row count; raises if it was drawn for another head_dim."""
        if head_dim != self.projection_FD.shape[1]:
            raise ValueError(
                f"FAVOR+ projection was drawn for head_dim={self.projection_FD.shape[1]}, "
                f"used with head_dim={head_dim}."
            )
        return self.projection_FD.shape[0]

    def _exponent(self, x):
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        x = x * x.shape[-1] ** -0.25
        wx = jnp.einsum("...d,fd->...f", x, self.projection_FD.astype(x.dtype))
        return wx - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)

    def __call__(self, x):
        self.num_features(x.shape[-1])
        f = self.projection_FD.shape[0]
        return jnp.exp(self._exponent(x)) / math.sqrt(f)

    def query(self, x):
        """phi(x) divided by exp(max_f exponent): the factor cancels in the normaliser, and
        large queries no longer overflow."""
        self.num_features(x.shape[-1])
        f = self.projection_FD.shape[0]
        e = self._exponent(x)
        e = e - jax.lax.stop_gradient(jnp.max(e, axis=-1, keepdims=True))
        return jnp.exp(e) / math.sqrt(f)

    def __repr__(self):
        f, d = self.projection_FD.shape
        return f"FavorFeatureMap(num_features={f}, head_dim={d})"


def favor_projection(key, num_features: int, head_dim: int, *, orthogonal: bool = True, dtype=jnp.float32):
    """Random [num_features, head_dim] matrix for FAVOR+.

    With `orthogonal=True` rows come in blocks of `head_dim` mutually orthogonal vectors whose
    norms follow the chi distribution of Gaussian rows (Performer's lower-variance estimator).
    """
    if num_features < 1 or head_dim < 1:
        raise ValueError(f"num_features and head_dim must be >= 1, got {num_features}, {head_dim}.")
    if not orthogonal:
        return jax.random.normal(key, (num_features, head_dim), dtype)
    num_blocks = -(-num_features // head_dim)
    block_key, norm_key = jax.random.split(key)
    gaussians = jax.random.normal(block_key, (num_blocks, head_dim, head_dim), jnp.float32)
    q_blocks, r_blocks = jnp.linalg.qr(gaussians)
    # Householder QR fixes sign(diag(R)), which biases Q; flipping columns by that sign makes
    # Q Haar-distributed, so every row is marginally isotropic and the estimator stays unbiased.
    q_blocks = q_blocks * jnp.sign(jnp.diagonal(r_blocks, axis1=-2, axis2=-1))[..., None, :]
    rows = jnp.swapaxes(q_blocks, -1, -2).reshape(num_blocks * head_dim, head_dim)[:num_features]
    norms = jnp.linalg.norm(jax.random.normal(norm_key, (num_features, head_dim), jnp.float32), axis=-1)
    return (rows * norms[:, None]).astype(dtype)


_REGISTRY: dict[str, Callable[..., FeatureMap]] = {}


def register_feature_map(name: str):
    """Decorator registering `factory(**options) -> FeatureMap` under `name`."""

    def wrap(factory):
        if name in _REGISTRY:
            raise ValueError(f"feature map {name!r} is already registered.")
        _REGISTRY[name] = factory
        return factory

    return wrap


@register_feature_map("elu")
def _make_elu():
    return CallableFeatureMap(elu_plus_one, "elu", pointwise=True)


@register_feature_map("relu")
def _make_relu():
    return CallableFeatureMap(jax.nn.relu, "relu", pointwise=True)


def identity(x):
    """phi(x) = x: no feature map, as the gated kinds (RetNet, GLA) use it. Not non-negative, so
    for unnormalised attention only (`gated_linear_attention(normalize=False)`)."""
    return x


@register_feature_map("identity")
def _make_identity():
    return CallableFeatureMap(identity, "identity", pointwise=True)


@register_feature_map("favor")
def _make_favor(*, key=None, head_dim=None, num_features=None, orthogonal=True, projection=None):
    if projection is None:
        if key is None or head_dim is None:
            raise ValueError(
                "feature map 'favor' (FAVOR+) draws a random matrix and needs an explicit RNG: "
                "make_feature_map('favor', key=jax.random.key(0), head_dim=D, num_features=F), "
                "or pass projection=favor_projection(key, F, D)."
            )
        projection = favor_projection(key, num_features or head_dim, head_dim, orthogonal=orthogonal)
    return FavorFeatureMap(projection)


def registered_feature_maps() -> list[str]:
    """Names `make_feature_map` accepts, sorted."""
    return sorted(_REGISTRY)


def make_feature_map(spec, **options) -> FeatureMap:
    """Resolve `spec` (a registered name, a FeatureMap, or a callable) to a FeatureMap."""
    if isinstance(spec, FeatureMap):
        if options:
            raise ValueError(
                f"options {sorted(options)} given with a FeatureMap instance {spec!r}; they would be ignored."
            )
        return spec
    if isinstance(spec, str):
        if spec not in _REGISTRY:
            raise ValueError(
                f"unknown feature map {spec!r}; registered feature maps: "
                f"{registered_feature_maps()} (or pass a callable)."
            )
        try:
            return _REGISTRY[spec](**options)
        except TypeError as e:
            raise ValueError(f"bad options {sorted(options)} for feature map {spec!r}: {e}") from e
    if callable(spec):
        if options:
            raise ValueError(
                f"options {sorted(options)} given with a callable feature map; they would be ignored."
            )
        return CallableFeatureMap(spec, getattr(spec, "__name__", repr(spec)))
    raise ValueError(
        f"feature_map must be a name from {registered_feature_maps()}, a FeatureMap "
        f"or a callable, got {spec!r}."
    )
