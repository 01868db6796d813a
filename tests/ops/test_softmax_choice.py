"""Which softmax form `implementation=None` runs, per platform, and that it runs that form.

The choice is a function of the platform and the arguments (`ops.softmax.default_implementation`),
so every platform's rule is tested here by passing the platform; the dispatch on this machine's
platform is tested by watching which form runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.ops import softmax

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

# A GPU-sized call: B = H = 8, T = S = 1024, bf16, D = M = 64: the float32 logits are 256 MiB.
CALL = dict(batch=8, heads=8, num_queries=1024, num_keys=1024, head_dim=64, value_dim=64)
LONG = dict(CALL, num_queries=16384, num_keys=16384)  # 68 GB of float32 logits


def choose(platform, dtype="bfloat16", **overrides):
    return softmax.default_implementation(platform, dtype=dtype, **{**CALL, **overrides})


def test_cudnn_on_an_nvidia_gpu_wherever_it_applies():
    assert choose("cuda") == "cudnn"
    assert choose("cuda", dtype="float16") == "cudnn"
    assert choose("cuda", **LONG) == "cudnn"  # no length limit: flash attention's memory is O(T)
    assert choose("cuda", head_dim=128, value_dim=128) == "cudnn"
    assert choose("cuda", head_dim=256, value_dim=256, cudnn_head_dims=256) == "cudnn"  # Hopper


@pytest.mark.parametrize(
    "why",
    [
        dict(dtype="float32"),  # cuDNN's flash attention takes half precision only
        dict(head_dim=64, value_dim=32),  # jax.nn.dot_product_attention needs M == D
        dict(head_dim=20, value_dim=20),  # not a multiple of 8
        dict(head_dim=256, value_dim=256),  # over 128 before Hopper
        dict(masked=True),  # an explicit mask would reach cuDNN as a dense [T, S] bias
        dict(segmented=True),  # so would segments
        dict(array_scale=True),  # cuDNN's scale is a static option: a number, not an array
    ],
    ids=lambda why: ",".join(f"{k}={v}" for k, v in why.items()),
)
def test_no_cudnn_where_it_does_not_apply(why):
    assert choose("cuda", **why) in ("xla", "reference")
    assert choose("cuda", **{**LONG, **why}) == "chunked"


def test_an_array_scale_is_refused_by_cudnn_by_name():
    q = jnp.ones((1, 8, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='cudnn' takes scale as a number .* got an array"):
        ops.softmax_attention(q, q, q, scale=jnp.asarray(0.5), implementation="cudnn")


def test_other_platforms_never_pick_cudnn():
    for platform in ("cpu", "tpu", "gpu"):
        assert choose(platform) != "cudnn"


def test_dense_forms_only_while_the_logits_fit():
    assert choose("cpu") == "blocked"  # the CPU's fastest form
    assert choose("tpu") == choose("gpu") == "xla"
    assert choose("tpu", value_dim=32) == "reference"  # dot_product_attention needs M == D
    for platform in ("cpu", "tpu", "gpu", "cuda"):
        assert choose(platform, dtype="float32", **LONG) == "chunked", platform
    # The boundary: logits of exactly DENSE_LOGITS_BYTES are dense, one key more is not.
    keys = softmax.DENSE_LOGITS_BYTES // (4 * 8 * 8 * 1024)
    assert choose("cpu", num_keys=keys) == "blocked"
    assert choose("cpu", num_keys=keys + 1) == "chunked"


def _spy(monkeypatch):
    """Record which forms softmax_attention runs (blocked, chunked, jax.nn's, the reference)."""
    ran = []

    def watch(module, name, label):
        original = getattr(module, name)

        def wrapped(*args, **kwargs):
            ran.append(label(kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    watch(softmax, "blocked_softmax_attention", lambda kw: "blocked")
    watch(softmax.softmax_chunked, "chunked_softmax_attention", lambda kw: "chunked")
    watch(softmax.jax.nn, "dot_product_attention", lambda kw: kw["implementation"])
    watch(softmax, "softmax_attention_reference", lambda kw: "reference")
    return ran


def _qkv(B=2, T=64, H=2, D=8, M=8):
    rng = np.random.default_rng(0)
    return tuple(
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, D),) * 2 + ((B, T, H, M),)
    )


def test_none_runs_the_form_chosen_for_this_platform(monkeypatch):
    ran = _spy(monkeypatch)
    q, k, v = _qkv()
    ops.softmax_attention(q, k, v, causal=True)
    expected = softmax.default_implementation(
        softmax.platform(),
        dtype=jnp.float32,
        batch=2,
        heads=2,
        num_queries=64,
        num_keys=64,
        head_dim=8,
        value_dim=8,
        cudnn_head_dims=softmax.cudnn_max_head_dim() if softmax.platform() == "cuda" else 128,
    )
    assert ran == [expected]


def test_none_runs_the_chunked_form_once_the_logits_would_not_fit(monkeypatch):
    """The same call past the dense limit (lowered here to 32 KiB) runs `softmax_chunked`, with
    segments passed as ids, and gives what the reference gives."""
    q, k, v = _qkv()
    ids = jnp.asarray(np.tile(np.repeat([1, 2], 32), (2, 1)), jnp.int32)
    expected = ops.softmax_attention(q, k, v, causal=True, segment_ids=ids, implementation="reference")
    monkeypatch.setattr(softmax, "DENSE_LOGITS_BYTES", 2**15)
    ran = _spy(monkeypatch)
    out = ops.softmax_attention(q, k, v, causal=True, segment_ids=ids)
    assert ran == ["chunked"]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_the_platform_is_named_as_the_choice_expects():
    assert softmax.platform() in ("cpu", "tpu", "cuda", "gpu")
    if jax.default_backend() == "cpu":
        assert softmax.platform() == "cpu"
