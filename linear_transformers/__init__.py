"""linear-transformers: Transformers are RNNs (Katharopoulos et al., 2020) in JAX and Flax NNX.

`linear_transformers.ops` holds the pure-JAX attention functions; the Flax NNX modules are
re-exported here; `linear_transformers.interop` reads the authors' PyTorch models.
"""

from linear_transformers import interop, mixture, ops
from linear_transformers.attention import (
    AttentionCore,
    FeatureProjection,
    HashRotations,
    register_attention,
    registered_attention_kinds,
    sequence_parallel_kinds,
    unregister_attention,
)
from linear_transformers.generation import generate, make_step_fn, scan_steps
from linear_transformers.image_generator import ImageGenerator, sample_images, sample_images_full_recompute
from linear_transformers.lm import CausalLM, LMState
from linear_transformers.mixture import bits_per_dim, mol_log_prob, mol_probs, mol_sample
from linear_transformers.multi_head_attention import MultiHeadAttention
from linear_transformers.packing import pack_sequences, segment_positions
from linear_transformers.seq2seq import EncoderDecoder, Seq2SeqState, greedy_decode
from linear_transformers.transformer import Decoder, DecoderLayer, Encoder, EncoderLayer, TransformerConfig

__all__ = [
    "ops",
    "interop",
    "AttentionCore",
    "FeatureProjection",
    "HashRotations",
    "register_attention",
    "registered_attention_kinds",
    "unregister_attention",
    "sequence_parallel_kinds",
    "generate",
    "make_step_fn",
    "scan_steps",
    "CausalLM",
    "LMState",
    "MultiHeadAttention",
    "pack_sequences",
    "segment_positions",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "TransformerConfig",
    "mixture",
    "ImageGenerator",
    "sample_images",
    "sample_images_full_recompute",
    "bits_per_dim",
    "mol_log_prob",
    "mol_probs",
    "mol_sample",
    "EncoderDecoder",
    "Seq2SeqState",
    "greedy_decode",
]
