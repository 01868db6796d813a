"""Finiteness checks for samplers: a model whose parameters or outputs hold NaN or inf has no
distribution to sample from, and sampling it must say so rather than return tokens or pixels
(argmax and categorical turn NaN logits into id 0 without a word)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def nonfinite_parameters(model: nnx.Module) -> list[str]:
    """The paths ("encoder/layers/0/...") of the model's parameter arrays holding NaN or inf; []
    when all are finite, or when the parameters are traced (inside `jit`: they cannot be read)."""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    if any(isinstance(x, jax.core.Tracer) for _, x in leaves):
        return []
    inexact = [(path, x) for path, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jax.device_get(_all_finite([x for _, x in inexact]))
    return [_path_name(path) for (path, _), ok in zip(inexact, finite) if not ok]


@jax.jit
def _all_finite(arrays: list) -> list:
    # One program for the whole model: checked an array at a time, each array shape would
    # compile two programs of its own (isfinite, all) and dispatch them.
    return [jnp.all(jnp.isfinite(x)) for x in arrays]


def _path_name(path) -> str:
    """ "encoder/layers/0/..." from a pytree path (a Param's own `.value` step left out)."""
    names = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value":
            continue
        names.append(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))))
    return "/".join(names)


def check_finite_parameters(model: nnx.Module, where: str) -> None:
    """A FloatingPointError naming the model's parameter arrays that hold NaN or inf."""
    bad = nonfinite_parameters(model)
    if bad:
        raise FloatingPointError(
            f"{where}: the model's parameters are not finite: {len(bad)} arrays hold NaN or inf "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), so there is no distribution "
            f"to sample from."
        )


def check_finite_outputs(finite_B, where: str, what: str = "tokens") -> None:
    """A FloatingPointError when a concrete `finite_B` (per example: every logit it was sampled
    from was finite) has a False; traced flags (inside `jit`) are left to the caller."""
    if isinstance(finite_B, jax.core.Tracer):
        return
    bad = int(jnp.sum(~jnp.asarray(finite_B)))
    if bad:
        raise FloatingPointError(
            f"{where}: the model's outputs are not finite (its parameters are) for {bad} of "
            f"{jnp.size(finite_B)} examples, so there is no distribution to sample their {what} from."
        )
