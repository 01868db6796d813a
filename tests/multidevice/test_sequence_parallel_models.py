"""Sequence-parallel models: TransformerConfig(sequence_axis="seq") under `jax.set_mesh`, on
inputs whose time axis is split over "seq", gives the logits and parameter gradients of the same
weights on one device (sequence_axis=None, no mesh): CausalLM, EncoderDecoder (source padding
included) and ImageGenerator, linear and softmax kinds, P = 2, 4, 8 devices; a ("data", "seq")
mesh; a mesh with explicit axis types.

The models stay in the global view (positions, losses, the START shift of the image model); the
attention ops wrap themselves in `jax.shard_map` over "seq".

Needs 8 devices: tests/test_multidevice.py runs this folder on 8 host CPU devices; elsewhere each
test skips (tests/conftest.py). Run alone with
XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    pytest -q tests/multidevice/test_sequence_parallel_models.py
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import small_config
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_transformers import CausalLM, EncoderDecoder
from linear_transformers.image_generator import ImageGenerator

B, T, S, E, H, V, C = 2, 16, 8, 16, 2, 11, 17  # T and S divide over 2, 4 and 8 devices
KINDS = {
    "linear": ("linear", {"chunk_size": 4}),  # local blocks of 8, 4, 2: chunks straddle
    "softmax": ("softmax", {}),
}
# Blocks of 4 steps on 4 devices: chunks of 2, the convolution's window of 4. KDA's per-feature
# decays over devices are tested on the op (test_sequence_parallel_family.py).
DELTA_KINDS = {"gated-deltanet": ("gated-deltanet", {"chunk_size": 2})}
TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=2e-5, rtol=2e-4)


def _config(name, sequence_axis):
    return small_config(*{**KINDS, **DELTA_KINDS}[name], sequence_axis=sequence_axis)


def _build(model_name, name, sequence_axis):
    config = _config(name, sequence_axis)
    rngs = nnx.Rngs(0)
    if model_name == "lm":
        return CausalLM(config, V, rngs=rngs)
    if model_name == "seq2seq":
        return EncoderDecoder(config, config, V, rngs=rngs)
    return ImageGenerator(config, num_classes=C, num_mixtures=2, max_length=T, rngs=rngs)


def _data(model_name, seed=0):
    """(inputs, targets): token arrays whose axis 1 is time (the source's too, for seq2seq)."""
    rng = np.random.default_rng(seed)
    if model_name == "lm":
        return (rng.integers(0, V, (B, T)).astype(np.int32),), rng.integers(0, V, (B, T))
    if model_name == "seq2seq":
        source = rng.integers(1, V, (B, S)).astype(np.int32)
        target_in = rng.integers(0, V, (B, T)).astype(np.int32)
        return (source, target_in), rng.integers(0, V, (B, T)).astype(np.int32)
    return (rng.integers(0, C, (B, T)).astype(np.int32),), None


SOURCE_LENGTHS = np.array([S, 3], np.int32)  # padding crosses device boundaries for P >= 4


def _loss(model, inputs, targets):
    """Mean loss and the model's output (logits, or mixture parameters)."""
    if isinstance(model, ImageGenerator):
        return model.nll(inputs[0]), model(inputs[0])
    if isinstance(model, EncoderDecoder):
        logits = model(*inputs, source_lengths=jnp.asarray(SOURCE_LENGTHS))
    else:
        logits = model(*inputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)), logits


# One compiled value_and_grad per call site and module structure.
_value_and_grad = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))


@functools.lru_cache(maxsize=None)
def _one_device(model_name, name):
    """The reference: sequence_axis=None, no mesh. -> (model, loss, output, grads)."""
    model = _build(model_name, name, None)
    inputs, targets = _data(model_name)
    (loss, out), grads = _value_and_grad(model, inputs, targets)
    return model, loss, out, grads


def _mesh(shape, names, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(
        shape, names, axis_types=(kind,) * len(names), devices=jax.devices()[: int(np.prod(shape))]
    )


def _sequence_parallel(model_name, name, mesh, spec, model=None):
    """The same weights built with sequence_axis="seq", run under `mesh` on inputs placed with
    `spec`: -> (loss, output, grads)."""
    ref_model = _one_device(model_name, name)[0]
    model = model or _build(model_name, name, "seq")
    nnx.update(model, nnx.state(ref_model))
    inputs, targets = _data(model_name)
    with jax.set_mesh(mesh):
        sharding = NamedSharding(mesh, spec)
        inputs = tuple(jax.device_put(x, sharding) for x in inputs)
        targets = None if targets is None else jax.device_put(targets, sharding)
        (loss, out), grads = _value_and_grad(model, inputs, targets)
    return loss, out, grads


def _check(model_name, name, got):
    _, loss1, out1, grads1 = _one_device(model_name, name)
    loss, out, grads = got
    np.testing.assert_allclose(loss, loss1, **TOL)
    np.testing.assert_allclose(out, out1, **TOL)
    chex.assert_trees_all_equal_shapes(grads, grads1)
    chex.assert_trees_all_close(grads, grads1, **GRAD_TOL)
    # Every parameter has a gradient, so the comparison covers them all.
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads1))


# Linear attention's decoder-only model on every P, its encoder-decoder (source padding crossing
# device boundaries) on 4 here and on 2 x 4 below; softmax's on 8 (its op on every P:
# test_sequence_parallel_ops.py).
@pytest.mark.parametrize(
    "name, model_name, p",
    [("linear", "lm", 2), ("linear", "lm", 8), ("linear", "seq2seq", 4), ("softmax", "lm", 8)],
)
def test_sequence_parallel_model_equals_one_device(model_name, name, p):
    got = _sequence_parallel(model_name, name, _mesh((p,), ("seq",)), P(None, "seq"))
    _check(model_name, name, got)


@pytest.mark.parametrize("name", list(DELTA_KINDS))
def test_sequence_parallel_delta_rule_kinds_equal_one_device(name):
    """A delta-rule kind's short convolution reads across device boundaries in the global view,
    and the delta rule composes the devices' maps of the state: loss, logits, gradients."""
    got = _sequence_parallel("lm", name, _mesh((4,), ("seq",)), P(None, "seq"))
    _check("lm", name, got)


@pytest.mark.parametrize("name, p", [("linear", 8), ("softmax", 4)])
def test_sequence_parallel_image_generator_equals_one_device(name, p):
    got = _sequence_parallel("image", name, _mesh((p,), ("seq",)), P(None, "seq"))
    _check("image", name, got)


@pytest.mark.parametrize(
    "name, model_name", [("linear", "lm"), ("linear", "seq2seq"), ("softmax", "seq2seq")]
)
def test_data_and_sequence_mesh_equals_one_device(name, model_name):
    """Batch over "data" (2), time over "seq" (4): the ops split the batch over the other axis."""
    got = _sequence_parallel(model_name, name, _mesh((2, 4), ("data", "seq")), P("data", "seq"))
    _check(model_name, name, got)


@pytest.mark.parametrize("name, sequence_axis", [("linear", "seq"), ("linear", None), ("softmax", None)])
def test_explicit_axes_mesh_equals_one_device(name, sequence_axis):
    """Explicit axis types: time-sharded inputs run sequence-parallel whether the model names
    the axis or not (the ops read it from the inputs' sharding)."""
    model = _build("lm", name, sequence_axis)
    got = _sequence_parallel("lm", name, _mesh((4,), ("seq",), explicit=True), P(None, "seq"), model=model)
    _check("lm", name, got)


def test_the_attention_really_runs_sequence_parallel():
    """The compiled program gathers per-device states (linear) or keys and values (softmax)
    over "seq", so the equalities above are not one device's computation in disguise."""
    for name, collective in (("linear", "all_gather"), ("softmax", "all_gather")):
        model = _build("lm", name, "seq")
        graphdef, params = nnx.split(model)
        inputs, _ = _data("lm")
        mesh = _mesh((4,), ("seq",))
        with jax.set_mesh(mesh):
            tokens = jax.device_put(inputs[0], NamedSharding(mesh, P(None, "seq")))
            jaxpr = str(jax.make_jaxpr(lambda p, x: nnx.merge(graphdef, p)(x))(params, tokens))
        assert "shard_map" in jaxpr and collective in jaxpr, name
