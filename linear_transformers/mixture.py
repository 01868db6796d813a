"""Discretized mixture of logistics over integer classes (PixelCNN++), one parametrisation throughout.

Legend: K mixture components, V classes, Q = 3K parameters per position; `...` any leading shape.

Class v in [0, V) sits at the center -1 + 2v / (V - 1) of a bin of half-width 1 / (V - 1); the
first and last bins extend to -inf and +inf, so the V bin probabilities of each logistic sum to 1.
The parameters' last axis is laid out [logits K | means K | log_scales K], and a component's scale
is exp(log_scale) with log_scale floored at LOG_SCALE_MIN in the loss and in the sampler alike
(the authors' sampler used elu(r) + 1.0001 while their loss used exp(r), so the model they sampled
from was not the one they trained).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

LOG_SCALE_MIN = -7.0


def _check_num_classes(num_classes: int, where: str):
    if not isinstance(num_classes, numbers.Integral) or num_classes < 2:
        raise ValueError(f"{where}: num_classes must be an int >= 2, got {num_classes!r}.")


def _check_params(params_Q, where: str):
    if params_Q.ndim < 1 or params_Q.shape[-1] == 0 or params_Q.shape[-1] % 3:
        raise ValueError(
            f"{where}: mixture params need a last axis of 3 * num_mixtures (logits | "
            f"means | log_scales), got shape {tuple(params_Q.shape)}."
        )


def num_params(num_mixtures: int) -> int:
    """Outputs per position for `num_mixtures` logistics: 3 * num_mixtures (logits, means, scales)."""
    if not isinstance(num_mixtures, numbers.Integral) or num_mixtures < 1:
        raise ValueError(f"num_params: num_mixtures must be an int >= 1, got {num_mixtures!r}.")
    return 3 * num_mixtures


def split_params(params_Q):
    """[..., 3K] -> (logits [..., K], means [..., K], log_scales [..., K]), all float32.

    log_scales are floored at LOG_SCALE_MIN. The split happens in float32 whatever the input dtype,
    because bf16 arithmetic cannot resolve a bin edge 1/255 away from a mean near 1.
    """
    params_Q = jnp.asarray(params_Q)
    _check_params(params_Q, "split_params")
    logits_K, means_K, log_scales_K = jnp.split(params_Q.astype(jnp.float32), 3, axis=-1)
    return logits_K, means_K, jnp.maximum(log_scales_K, LOG_SCALE_MIN)


def class_centers(num_classes: int):
    """The V bin centers -1 + 2v / (V - 1) in [-1, 1], float32."""
    _check_num_classes(num_classes, "class_centers")
    return -1.0 + 2.0 * jnp.arange(num_classes, dtype=jnp.float32) / (num_classes - 1)


# Compiled because eager dispatch of these ~30 small ops dominates on CPU.
@functools.partial(jax.jit, static_argnums=2)
def _log_prob(params_Q, x, num_classes: int):
    """log P(x) with x broadcastable against params_Q.shape[:-1]; no argument checks."""
    x = x.astype(jnp.int32)  # uint8 images: comparisons with V = 256 would wrap around
    logits_K, means_K, log_scales_K = split_params(params_Q)
    half_width = 1.0 / (num_classes - 1)
    # Bin edges (2x - V + 2) / (V - 1) and (2x - V) / (V - 1): exact integers divided once, so
    # each edge is rounded once: at scale exp(-7) one rounding of an edge near 1 costs ~1e-4 nats.
    twice_x = 2.0 * x.astype(jnp.float32)
    upper_edge = (twice_x + (2 - num_classes)) / (num_classes - 1)
    lower_edge = (twice_x - num_classes) / (num_classes - 1)
    inv_scale_K = jnp.exp(-log_scales_K)
    upper_K = inv_scale_K * (upper_edge[..., None] - means_K)  # standardised bin edges
    lower_K = inv_scale_K * (lower_edge[..., None] - means_K)
    # sigmoid(u) - sigmoid(l) = sigmoid(u) * sigmoid(-l) * (1 - exp(-(u - l))): every factor is
    # evaluated in log space and the width u - l comes straight from the scale, never from a
    # difference of two large numbers, so it stays accurate where PixelCNN++ needs a log-pdf fallback.
    # The floor only guards against log(0) once exp(-log_scale) underflows (log_scale > ~87).
    width_K = jnp.maximum(2.0 * half_width * inv_scale_K, jnp.finfo(jnp.float32).tiny)
    middle_K = jax.nn.log_sigmoid(upper_K) + jax.nn.log_sigmoid(-lower_K) + jnp.log(-jnp.expm1(-width_K))
    first_K = jax.nn.log_sigmoid(upper_K)  # bin (-inf, upper]
    last_K = jax.nn.log_sigmoid(-lower_K)  # bin [lower, +inf)
    x_K = x[..., None]
    # All three branches are finite everywhere, so jnp.where passes finite gradients.
    component_K = jnp.where(x_K == 0, first_K, jnp.where(x_K == num_classes - 1, last_K, middle_K))
    log_prob = jax.nn.logsumexp(jax.nn.log_softmax(logits_K, axis=-1) + component_K, axis=-1)
    # Classes outside [0, V) have probability zero; -inf makes a loss on them fail loudly.
    return jnp.where((x >= 0) & (x < num_classes), log_prob, -jnp.inf)


def mol_log_prob(params_Q, x, num_classes: int):
    """Natural-log probability of integer classes x [...] under params [..., 3K]: float32 [...].

    Classes outside [0, num_classes) get -inf.
    """
    _check_num_classes(num_classes, "mol_log_prob")
    params_Q, x = jnp.asarray(params_Q), jnp.asarray(x)
    _check_params(params_Q, "mol_log_prob")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"mol_log_prob: x must hold integer classes, got dtype {x.dtype}.")
    if tuple(x.shape) != tuple(params_Q.shape[:-1]):
        raise ValueError(
            f"mol_log_prob: x shape {tuple(x.shape)} must equal the params' leading "
            f"shape {tuple(params_Q.shape[:-1])} (params shape {tuple(params_Q.shape)})."
        )
    return _log_prob(params_Q, x, num_classes)


def mol_probs(params_Q, num_classes: int):
    """Probabilities of every class: params [..., 3K] -> float32 [..., V], summing to 1."""
    _check_num_classes(num_classes, "mol_probs")
    params_Q = jnp.asarray(params_Q)
    _check_params(params_Q, "mol_probs")
    classes_V = jnp.arange(num_classes, dtype=jnp.int32)
    return jnp.exp(_log_prob(params_Q[..., None, :], classes_V, num_classes))


def mol_sample(key, params_Q, num_classes: int):
    """Draw classes int32 [...] from params [..., 3K]: the distribution `mol_log_prob` scores.

    A component is picked from the logits, a logistic drawn with its mean and scale
    exp(log_scale), and the draw mapped to the bin containing it (the nearest center, clipped to
    [0, V - 1], which is how the edge bins reach to infinity).

    Params holding NaN or inf describe no distribution, and no class is drawn from them: an
    eager call raises a FloatingPointError; under `jit` (traced params, where nothing can raise)
    the draw at such a position is -1, never a class, for the caller to check (`sample_images`
    does, and raises).
    """
    _check_num_classes(num_classes, "mol_sample")
    params_Q = jnp.asarray(params_Q)
    _check_params(params_Q, "mol_sample")
    if not isinstance(params_Q, jax.core.Tracer):
        finite = np.isfinite(np.asarray(params_Q, np.float32)).all(axis=-1)
        if not finite.all():
            raise FloatingPointError(
                f"mol_sample: the mixture parameters are not finite at {int((~finite).sum())} of "
                f"{finite.size} positions (NaN or inf): the model's parameters or outputs are not "
                f"finite, so there is no distribution to sample from."
            )
    return _sample(key, params_Q, num_classes)


@functools.partial(jax.jit, static_argnums=2)
def _sample(key, params_Q, num_classes: int):
    logits_K, means_K, log_scales_K = split_params(params_Q)
    component_key, logistic_key = jax.random.split(key)
    k = jax.random.categorical(component_key, logits_K, axis=-1)[..., None]
    mean = jnp.take_along_axis(means_K, k, axis=-1)[..., 0]
    log_scale = jnp.take_along_axis(log_scales_K, k, axis=-1)[..., 0]
    y = mean + jnp.exp(log_scale) * jax.random.logistic(logistic_key, mean.shape, jnp.float32)
    # Clip before the cast: a draw far outside [-1, 1] must not overflow the int conversion.
    index = jnp.clip(jnp.round((y + 1.0) * (0.5 * (num_classes - 1))), 0, num_classes - 1)
    # NaN would cast to some class (0: a black pixel): -1 marks "no distribution" instead.
    finite = jnp.all(jnp.isfinite(params_Q), axis=-1)
    return jnp.where(finite, index.astype(jnp.int32), -1)


def bits_per_dim(nll_nats):
    """Negative log-likelihood in nats per dimension -> bits per dimension (divide by ln 2)."""
    return nll_nats / math.log(2.0)
