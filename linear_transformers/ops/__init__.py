"""Pure-JAX attention ops (no Flax): softmax, linear, causal linear, gated linear (decayed: RetNet,
Mamba-2, GLA), the delta rule (DeltaNet, Gated DeltaNet, KDA), and their recurrent steps; the
baselines LSH (Reformer) and Linformer.

Layout follows `jax.nn.dot_product_attention`: queries [B, T, H, D], keys [B, S, H, D],
values [B, S, H, M].
"""

from linear_transformers import _deprecation
from linear_transformers.ops import sequence_parallel
from linear_transformers.ops.causal_linear import causal_linear_attention, causal_linear_attention_prefill
from linear_transformers.ops.delta_rule import (
    delta_rule_attention,
    delta_rule_attention_prefill,
    delta_rule_attention_step,
)
from linear_transformers.ops.feature_maps import (
    CallableFeatureMap,
    FavorFeatureMap,
    FeatureMap,
    elu_plus_one,
    favor_projection,
    make_feature_map,
    register_feature_map,
    registered_feature_maps,
)
from linear_transformers.ops.gated_linear import (
    DEFAULT_CHUNK_SIZE,
    LINEAR_IMPLEMENTATIONS,
    gated_linear_attention,
    gated_linear_attention_prefill,
    gated_linear_attention_step,
)
from linear_transformers.ops.input_checks import check_segment_ids
from linear_transformers.ops.kv_cache import (
    KVCache,
    init_kv_cache,
    softmax_attention_prefill,
    softmax_attention_prefill_reference,
    softmax_attention_step,
    softmax_attention_step_reference,
)
from linear_transformers.ops.linear import (
    linear_attention,
    linear_attention_from_state,
    linear_attention_reference,
    linear_attention_step,
    linear_state_from_keys,
)
from linear_transformers.ops.linear_state import LinearState, init_linear_state
from linear_transformers.ops.linformer import linformer_attention, linformer_project
from linear_transformers.ops.lsh import (
    check_lsh_options,
    lsh_attention,
    lsh_attention_reference,
    lsh_hashes,
    lsh_rotations,
)
from linear_transformers.ops.rotary import rotary_embedding
from linear_transformers.ops.short_convolution import (
    init_short_convolution_state,
    short_convolution,
    short_convolution_step,
)
from linear_transformers.ops.softmax import (
    softmax_attention,
    softmax_attention_reference,
    softmax_attention_weights,
)

__all__ = [
    "sequence_parallel",
    "DEFAULT_CHUNK_SIZE",
    "LINEAR_IMPLEMENTATIONS",
    "causal_linear_attention",
    "causal_linear_attention_prefill",
    "check_segment_ids",
    "gated_linear_attention",
    "gated_linear_attention_prefill",
    "gated_linear_attention_step",
    "delta_rule_attention",
    "delta_rule_attention_prefill",
    "delta_rule_attention_step",
    "CallableFeatureMap",
    "FavorFeatureMap",
    "FeatureMap",
    "elu_plus_one",
    "favor_projection",
    "make_feature_map",
    "register_feature_map",
    "registered_feature_maps",
    "LinearState",
    "init_linear_state",
    "linear_attention",
    "linear_attention_from_state",
    "linear_attention_reference",
    "linear_attention_step",
    "linear_state_from_keys",
    "KVCache",
    "init_kv_cache",
    "softmax_attention",
    "softmax_attention_prefill",
    "softmax_attention_prefill_reference",
    "softmax_attention_reference",
    "softmax_attention_step",
    "softmax_attention_step_reference",
    "softmax_attention_weights",
    "linformer_attention",
    "linformer_project",
    "check_lsh_options",
    "lsh_attention",
    "lsh_attention_reference",
    "lsh_hashes",
    "lsh_rotations",
    "rotary_embedding",
    "init_short_convolution_state",
    "short_convolution",
    "short_convolution_step",
]

# The old name of LINEAR_IMPLEMENTATIONS, until the next release.
__getattr__ = _deprecation.moved_names(__name__, {"IMPLS": "linear_transformers.ops:LINEAR_IMPLEMENTATIONS"})
