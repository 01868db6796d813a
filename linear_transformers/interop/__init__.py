"""Interoperability with the authors' PyTorch library, pytorch-fast-transformers.

`config_from_builder_kwargs` (also `TransformerConfig.from_kwargs`) reads their builders'
arguments; `encoder_from_fast_transformers`, `decoder_from_fast_transformers` and
`image_generator_from_fast_transformers` load their weights into our modules;
`load_torch_checkpoint` reads a `.pth` state dict (with the optional `torch` extra),
`load_state_dict` that or a `.npz` archive of the same arrays.
"""

from linear_transformers.interop.convert import (
    as_numpy_state_dict,
    config_from_builder_kwargs,
    decoder_from_fast_transformers,
    encoder_from_fast_transformers,
    generator_config,
    image_generator_from_fast_transformers,
    load_state_dict,
    load_torch_checkpoint,
)

__all__ = [
    "config_from_builder_kwargs",
    "as_numpy_state_dict",
    "decoder_from_fast_transformers",
    "encoder_from_fast_transformers",
    "generator_config",
    "image_generator_from_fast_transformers",
    "load_state_dict",
    "load_torch_checkpoint",
]
