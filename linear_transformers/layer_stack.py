"""A stack of identical layers kept as one layer whose variables have a leading axis of L, and
run by a scan over that axis.

Legend: L layers.

Why: XLA compiles a Python loop over L layers as L copies of the layer, and the optimizer
updates each layer's arrays one by one: the first training step of the paper's 8-layer MNIST
model compiled for 35-51 s on an H100, and longer with every layer. Stacked, each parameter is
one [L, ...] array and `nnx.scan` runs one compiled layer L times, so the compile time of the
step (the optimizer's included) no longer grows with the depth (BENCHMARKS.md, section 8).

  layers = stack([make_layer() for _ in range(L)])       the same values as the list
  x = run(layers, x, lambda layer, x: layer(x))          parallel form: x carried through
  states = init(layers, lambda layer: layer.init_state(...))   one state per layer, stacked
  states, x = run_with_state(layers, states, x, lambda layer, state, x: layer.step(state, x))

A recurrent state is the per-layer states stacked the same way: every array of it has a
leading axis of L.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def stack(layers: list[nnx.Module]) -> nnx.Module:
    """One module of the layers' class whose every variable (parameters, RNG keys and counts)
    holds the layers' values stacked along a new leading axis, layer i at index i."""
    if not layers:
        raise ValueError("layer_stack.stack: no layers to stack.")
    graphdefs, states = zip(*(nnx.split(layer) for layer in layers))
    if any(graphdef != graphdefs[0] for graphdef in graphdefs):
        raise ValueError(
            "layer_stack.stack: the layers differ in structure or static attributes; only "
            "identical layers (one config) stack."
        )
    return nnx.merge(graphdefs[0], jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def layer(layers: nnx.Module, i: int) -> nnx.Module:
    """A copy of layer `i` of a stack, as a module of its own (changing it changes nothing in
    the stack)."""
    graphdef, state = nnx.split(layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))


class _CarryDtypesChanged(Exception):
    """Raised while the scan traces its body: a layer returned its carry in other dtypes."""

    def __init__(self, dtypes):
        super().__init__(dtypes)
        self.dtypes = dtypes


def _check_carry_dtypes(carry_in, carry_out) -> None:
    """Raises `_CarryDtypesChanged` (the output's dtypes) where a carry of one structure changed
    dtypes; another structure is left to `lax.scan`'s own error."""
    if jax.tree.structure(carry_in) != jax.tree.structure(carry_out):
        return
    dtypes = jax.tree.map(jnp.result_type, carry_out)
    if jax.tree.leaves(dtypes) != jax.tree.leaves(jax.tree.map(jnp.result_type, carry_in)):
        raise _CarryDtypesChanged(dtypes)


def _scan(layers: nnx.Module, carry, xs, call, unroll: int = 1):
    """`carry, out_i = call(layer_i, carry, xs_i)` for each layer in order, as one `lax.scan`
    over the stacked variables: -> (carry, outs stacked).

    A plain `lax.scan` over `nnx.split` state, not `nnx.scan`: NNX's transforms refuse a
    module from another trace level, and a sampler's `lax.scan` over time calls `step` on a
    model it closes over. Variables a layer writes (dropout's RNG counts while training,
    intermediates it sows) are written back to the stack, stacked; in inference nothing is
    written, so a model closed over by any JAX transform runs.
    """
    graphdef, state = nnx.split(layers)
    written = []  # (path, the variable as the layer left it), found while tracing the body

    def body(carry, scanned):
        layer_state, x = scanned
        before = {path: variable.get_value() for path, variable in nnx.to_flat_state(layer_state)}
        layer = nnx.merge(graphdef, layer_state)
        carry_in, (carry, out) = carry, call(layer, carry, x)
        _check_carry_dtypes(carry_in, carry)
        changed = [
            (path, variable)
            for path, variable in nnx.to_flat_state(nnx.state(layer))
            if path not in before or variable.get_value() is not before[path]
        ]
        written[:] = changed
        return carry, (out, [variable.get_value() for _, variable in changed])

    # All layers in one iteration: straight-line code, without the loop's cost to compile and
    # run (a stack of one layer always).
    length = jax.tree.leaves(state)[0].shape[0]
    unroll = True if unroll >= length else unroll
    try:
        carry, (outs, values) = jax.lax.scan(body, carry, (state, xs), unroll=unroll)
    except _CarryDtypesChanged as changed:
        # A layer may return its carry in another dtype than it took (bf16 inputs to float32
        # layers): the scan's carry takes the layer's output dtypes from the start. Found in
        # the scan's own trace of the body, so a carry that keeps its dtypes is traced once.
        carry = jax.tree.map(lambda c, dtype: c.astype(dtype), carry, changed.dtypes)
        carry, (outs, values) = jax.lax.scan(body, carry, (state, xs), unroll=unroll)
    if written:
        updates = [(path, variable.replace(value)) for (path, variable), value in zip(written, values)]
        nnx.update(layers, nnx.from_flat_state(updates))
    return carry, outs


def run(layers: nnx.Module, x, call, *, unroll: int = 1):
    """`x = call(layer, x)` for each layer in order, as one scan (`unroll` layers per
    iteration)."""
    x, _ = _scan(layers, x, None, lambda layer, x, _: (call(layer, x), None), unroll)
    return x


def run_with_state(layers: nnx.Module, states, x, call, *, unroll: int = 1):
    """`state_i, x = call(layer_i, state_i, x)` for each layer in order, as one scan over the
    layers and their stacked states (`unroll` layers per iteration): -> (stacked new states,
    x)."""

    def each(layer, x, state):
        state, x = call(layer, state, x)
        return x, state

    x, states = _scan(layers, x, states, each, unroll)
    return states, x


def init(layers: nnx.Module, call):
    """`call(layer)` of every layer (its initial recurrent state), stacked."""
    graphdef, state = nnx.split(layers)
    return jax.vmap(lambda layer_state: call(nnx.merge(graphdef, layer_state)))(state)
