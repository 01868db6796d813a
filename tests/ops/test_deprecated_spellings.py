"""The old spellings keep working for one release: each warns (DeprecationWarning, naming the new
spelling) and gives what the new one gives; the old and the new together are a ValueError."""

import chex
import jax
import pytest

from linear_transformers import ops
from linear_transformers.attention import LinearOptions, check_attention_options
from linear_transformers.ops import gated_linear


def _qkv(T=6):
    return tuple(jax.random.normal(jax.random.key(i), (1, T, 1, 2)) for i in range(3))


@pytest.mark.parametrize("op", [ops.causal_linear_attention, ops.gated_linear_attention])
def test_the_impl_keyword_and_the_quadratic_value(op):
    q, k, v = _qkv()
    with pytest.warns(DeprecationWarning, match=r"'impl' is deprecated.*use 'implementation'"):
        old = op(q, k, v, impl="scan")
    chex.assert_trees_all_close(old, op(q, k, v, implementation="scan"))
    with pytest.warns(DeprecationWarning, match=r"implementation='quadratic'.*implementation='reference'"):
        old = op(q, k, v, implementation="quadratic")
    chex.assert_trees_all_close(old, op(q, k, v, implementation="reference"))
    with pytest.raises(ValueError, match=r"'impl' is the deprecated spelling of 'implementation'"):
        op(q, k, v, impl="scan", implementation="scan")


def test_the_impl_keyword_on_a_prefill():
    q, k, v = _qkv()
    state = ops.init_linear_state(1, 1, 2, 2)
    with pytest.warns(DeprecationWarning, match=r"'impl' is deprecated"):
        old = ops.causal_linear_attention_prefill(state, q, k, v, impl="scan")
    new = ops.causal_linear_attention_prefill(state, q, k, v, implementation="scan")
    chex.assert_trees_all_close(old, new)


def test_the_impl_option_key():
    with pytest.warns(DeprecationWarning, match=r"'impl' is deprecated.*use 'implementation'"):
        old = check_attention_options("causal-linear", {"impl": "scan"})
    assert old == LinearOptions(implementation="scan")
    with pytest.warns(DeprecationWarning, match=r"implementation='quadratic'"):
        assert LinearOptions(implementation="quadratic") == LinearOptions(implementation="reference")
    with pytest.raises(ValueError, match=r"'impl'.*'implementation'"):
        check_attention_options("gla", {"impl": "scan", "implementation": "scan"})
    with pytest.raises(ValueError, match=r"unknown implementation 'fast'; expected one of \('reference'"):
        check_attention_options("gla", {"implementation": "fast"})


def test_moved_names():
    from linear_transformers.ops import chunk_segments, gated_forms

    with pytest.warns(DeprecationWarning, match=r"ops\.IMPLS is deprecated.*ops\.LINEAR_IMPLEMENTATIONS"):
        assert (
            ops.IMPLS
            == ops.LINEAR_IMPLEMENTATIONS
            == ("reference", "associative_scan", "chunked", "scan", "pallas")
        )
    with pytest.warns(DeprecationWarning, match=r"gated_linear\.chunked\.DEFAULT_CHUNK_SIZE"):
        assert gated_forms.DEFAULT_CHUNK_SIZE == gated_linear.DEFAULT_CHUNK_SIZE
    with pytest.warns(DeprecationWarning, match=r"gated_linear\.chunk_segments\.run_segments"):
        assert chunk_segments.run_segments is gated_linear.chunk_segments.run_segments
    with pytest.raises(AttributeError, match=r"chunked_from_raw was removed: every form takes raw inputs"):
        gated_forms.chunked_from_raw
