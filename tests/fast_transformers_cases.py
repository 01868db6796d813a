"""Reference outputs of the authors' library (pytorch-fast-transformers) for the interop tests.

Run with torch and pytorch-fast-transformers installed (CPU build; see
experiments/benchmarking/peers.py) to regenerate the fixtures the tests read:

    python tests/fast_transformers_cases.py      # writes tests/fixtures/fast_transformers/*.npz

Each case builds one of their models from builder keyword arguments on random weights (LayerNorm
parameters perturbed off 1 and 0), runs it on random inputs with length and causal masks, and
returns {"meta": json, "state/<name>": weights, "input/<name>": ..., "output/<name>": ...} as
numpy arrays. `tests/models/test_fast_transformers_interop.py` converts the weights and compares; when
`fast_transformers` is importable it also calls these functions live on random sizes.

The colab's `Generator` / `RecurrentGenerator` (the authors' MNIST demo) are rebuilt here with the
same submodules and names; `pixelcnn_log_prob` is the PixelCNN++ discretized-logistic
log-likelihood their heads were trained with, written from the PixelCNN++ paper's definition.
"""

from __future__ import annotations

import json
import math
import pathlib
import warnings

import numpy as np

from linear_transformers.interop import config_from_builder_kwargs

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "fast_transformers"


def load_case(name: str) -> dict:
    """A fixture's arrays by key."""
    with np.load(FIXTURES / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def split_case(case: dict):
    """(the builder's meta data, the PyTorch state dict) of a fixture."""
    meta = json.loads(str(case["meta"]))
    state = {k[len("state/") :]: v for k, v in case.items() if k.startswith("state/")}
    return meta, state


def case_config(meta: dict):
    """Our config of the fixture's model, from the authors' builder keywords."""
    with warnings.catch_warnings():
        # The colab passes attention_dropout and softmax_temp whatever the kind.
        warnings.simplefilter("ignore", UserWarning)
        return config_from_builder_kwargs(**meta["builder_kwargs"])


def mnist_sized_state(path):
    """The tiny generator's weights with a 783-row position table: a model of 28 x 28 images
    (the table is the only length-dependent array), saved as .npz."""
    _, state = split_case(load_case("generator_causal_linear"))
    width = state["pos_embedding.pe"].shape[-1]
    angles = np.arange(783, dtype=np.float32)[:, None] * np.exp(
        np.arange(0, width, 2, dtype=np.float32) * np.float32(-np.log(1e4) / width)
    )
    table = np.empty((1, 783, width), np.float32)
    table[0, :, 0::2], table[0, :, 1::2] = np.sin(angles), np.cos(angles)
    state["pos_embedding.pe"] = table
    np.savez(path, **state)
    return path


def _torch():
    import torch

    return torch


def _perturb_norms(model, generator):
    torch = _torch()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in name or name.startswith("norm"):
                p.add_(0.2 * torch.randn(p.shape, generator=generator))


def _state(model) -> dict:
    return {f"state/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _meta(**fields) -> dict:
    return {"meta": np.array(json.dumps(fields))}


def encoder_case(builder_kwargs: dict, *, causal: bool, batch=3, length=7, seed=0) -> dict:
    """TransformerEncoder with a LengthMask (and a TriangularCausalMask when causal), and the
    same weights in a RecurrentEncoder stepped token by token (causal only)."""
    torch = _torch()
    from fast_transformers.builders import RecurrentEncoderBuilder, TransformerEncoderBuilder
    from fast_transformers.masking import LengthMask, TriangularCausalMask

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TransformerEncoderBuilder.from_kwargs(**builder_kwargs).get().eval()
    _perturb_norms(model, g)
    width = builder_kwargs["n_heads"] * builder_kwargs["value_dimensions"]
    x = torch.randn(batch, length, width, generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    with torch.no_grad():
        out = model(
            x,
            attn_mask=TriangularCausalMask(length) if causal else None,
            length_mask=LengthMask(lengths, max_len=length),
        )
    case = {
        **_meta(model="encoder", causal=causal, builder_kwargs=builder_kwargs),
        **_state(model),
        "input/x": x.numpy(),
        "input/lengths": lengths.numpy(),
        "output/parallel": out.numpy(),
    }
    if causal:
        recurrent = RecurrentEncoderBuilder.from_kwargs(**builder_kwargs).get().eval()
        recurrent.load_state_dict(model.state_dict())
        state, steps = None, []
        with torch.no_grad():
            for t in range(length):
                y, state = recurrent(x[:, t], state=state)
                steps.append(y)
        case["output/recurrent"] = torch.stack(steps, 1).numpy()
    return case


def decoder_case(builder_kwargs: dict, *, batch=3, length=6, memory_length=5, seed=0) -> dict:
    """TransformerDecoder with a causal self-attention mask, target and memory LengthMasks,
    and the same weights in a RecurrentDecoder stepped token by token."""
    torch = _torch()
    from fast_transformers.builders import RecurrentDecoderBuilder, TransformerDecoderBuilder
    from fast_transformers.masking import LengthMask, TriangularCausalMask

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TransformerDecoderBuilder.from_kwargs(**builder_kwargs).get().eval()
    _perturb_norms(model, g)
    width = builder_kwargs["n_heads"] * builder_kwargs["value_dimensions"]
    x = torch.randn(batch, length, width, generator=g)
    memory = torch.randn(batch, memory_length, width, generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    memory_lengths = torch.randint(1, memory_length + 1, (batch,), generator=g)
    lengths[0], memory_lengths[0] = length, memory_length
    memory_mask = LengthMask(memory_lengths, max_len=memory_length)
    with torch.no_grad():
        out = model(
            x,
            memory,
            x_mask=TriangularCausalMask(length),
            x_length_mask=LengthMask(lengths, max_len=length),
            memory_length_mask=memory_mask,
        )
    recurrent = RecurrentDecoderBuilder.from_kwargs(**builder_kwargs).get().eval()
    recurrent.load_state_dict(model.state_dict())
    state, steps = None, []
    with torch.no_grad():
        for t in range(length):
            y, state = recurrent(x[:, t], memory, memory_length_mask=memory_mask, state=state)
            steps.append(y)
    return {
        **_meta(model="decoder", causal=True, builder_kwargs=builder_kwargs),
        **_state(model),
        "input/x": x.numpy(),
        "input/lengths": lengths.numpy(),
        "input/memory": memory.numpy(),
        "input/memory_lengths": memory_lengths.numpy(),
        "output/parallel": out.numpy(),
        "output/recurrent": torch.stack(steps, 1).numpy(),
    }


def _positional_table(d_model: int, max_len: int):
    """The colab's PositionalEncoding buffer: sin at even, cos at odd features."""
    torch = _torch()
    pe = torch.zeros(max_len, d_model)
    position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.unsqueeze(0)


def _generator_modules(
    recurrent: bool, d_model, sequence_length, mixtures, attention_type, n_layers, n_heads, d_query
):
    """The colab's Generator (recurrent=False) or RecurrentGenerator: the same submodule names
    (pos_embedding with its `pe` buffer, value_embedding, transformer, predictor)."""
    torch = _torch()
    from fast_transformers.builders import RecurrentEncoderBuilder, TransformerEncoderBuilder

    class PositionalEncoding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pe", _positional_table(d_model // 2, sequence_length))

    class Generator(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_embedding = PositionalEncoding()
            self.value_embedding = torch.nn.Embedding(256, d_model // 2)
            builder = RecurrentEncoderBuilder if recurrent else TransformerEncoderBuilder
            self.transformer = builder.from_kwargs(
                attention_type=attention_type,
                n_layers=n_layers,
                n_heads=n_heads,
                feed_forward_dimensions=n_heads * d_query * 4,
                query_dimensions=d_query,
                value_dimensions=d_query,
                dropout=0.1,
                softmax_temp=None,
                attention_dropout=0.1,
            ).get()
            self.predictor = torch.nn.Linear(n_heads * d_query, mixtures * 3)

        def forward(self, x):  # Generator.forward
            from fast_transformers.masking import TriangularCausalMask

            x = self.value_embedding(x.view(x.shape[0], -1))
            pe = self.pos_embedding.pe[:, : x.size(1), :].expand(x.shape[0], -1, -1)
            x = torch.cat([x, pe], dim=2)
            return self.predictor(self.transformer(x, attn_mask=TriangularCausalMask(x.shape[1])))

        def step(self, x, i, memory):  # RecurrentGenerator.forward
            x = self.value_embedding(x.view(x.shape[0]))
            x = torch.cat([x, self.pos_embedding.pe[0, i : i + 1].expand_as(x)], dim=1)
            y, memory = self.transformer(x, memory)
            return self.predictor(y), memory

    return Generator()


def pixelcnn_log_prob(y_hat, x, num_classes=256):
    """PixelCNN++'s discretized mixture-of-logistics log-likelihood of classes x [...] under
    y_hat [..., 3K] = [logits | means | raw log-scales], one channel, x scaled to [-1, 1]."""
    torch = _torch()
    F = torch.nn.functional
    K = y_hat.shape[-1] // 3
    logits, means, log_scales = y_hat[..., :K], y_hat[..., K : 2 * K], y_hat[..., 2 * K :]
    log_scales = torch.clamp(log_scales, min=-7.0)
    x = (x.float() / (num_classes - 1) * 2 - 1).unsqueeze(-1)
    centered = x - means
    inv_scale = torch.exp(-log_scales)
    plus_in = inv_scale * (centered + 1.0 / (num_classes - 1))
    min_in = inv_scale * (centered - 1.0 / (num_classes - 1))
    cdf_delta = torch.sigmoid(plus_in) - torch.sigmoid(min_in)
    log_cdf_plus = plus_in - F.softplus(plus_in)  # first bin, (-inf, upper]
    log_one_minus_cdf_min = -F.softplus(min_in)  # last bin, [lower, inf)
    mid_in = inv_scale * centered
    log_pdf_mid = mid_in - log_scales - 2.0 * F.softplus(mid_in)
    middle = torch.where(
        cdf_delta > 1e-5,
        torch.log(torch.clamp(cdf_delta, min=1e-12)),
        log_pdf_mid - math.log((num_classes - 1) / 2),
    )
    log_probs = torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, middle))
    return torch.logsumexp(log_probs + torch.log_softmax(logits, -1), dim=-1)


def generator_case(
    attention_type: str, *, d_model=16, n_heads=2, n_layers=2, mixtures=3, image_length=12, batch=2, seed=0
) -> dict:
    """The colab's Generator on random images (parallel, reading x[:-1]), the same weights in its
    RecurrentGenerator stepped, PixelCNN++ log-likelihoods of x[1:] and every class's
    probability at every position."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    d_query = d_model // n_heads
    args = (d_model, image_length - 1, mixtures)
    model = _generator_modules(False, *args, attention_type, n_layers, n_heads, d_query).eval()
    _perturb_norms(model.transformer, g)
    recurrent_type = "linear" if attention_type == "causal-linear" else attention_type
    recurrent = _generator_modules(True, *args, recurrent_type, n_layers, n_heads, d_query).eval()
    recurrent.load_state_dict(model.state_dict())
    images = torch.randint(0, 256, (batch, image_length), generator=g)
    with torch.no_grad():
        y_hat = model(images[:, :-1])
        memory, steps = None, []
        for i in range(image_length - 1):
            y, memory = recurrent.step(images[:, i : i + 1], i, memory)
            steps.append(y)
        log_prob = pixelcnn_log_prob(y_hat, images[:, 1:]).sum(-1)
        classes = torch.arange(256)
        probs = torch.exp(pixelcnn_log_prob(y_hat[..., None, :], classes.expand(*y_hat.shape[:-1], 256)))
    generator_kwargs = dict(
        d_model=d_model, n_heads=n_heads, n_layers=n_layers, mixtures=mixtures, attention_type=attention_type
    )
    return {
        **_meta(model="generator", generator_kwargs=generator_kwargs),
        **_state(model),
        "input/images": images.numpy(),
        "output/parallel": y_hat.numpy(),
        "output/recurrent": torch.stack(steps, 1).numpy(),
        "output/log_prob": log_prob.numpy(),
        "output/probs": probs.numpy(),
    }


_SMALL = dict(n_layers=2, n_heads=3, query_dimensions=5, value_dimensions=4, feed_forward_dimensions=24)

CASES = {
    "encoder_full": lambda: encoder_case(
        dict(_SMALL, attention_type="full", activation="gelu"), causal=False
    ),
    "encoder_full_causal": lambda: encoder_case(
        dict(_SMALL, attention_type="full", softmax_temp=0.3), causal=True, seed=1
    ),
    "encoder_linear": lambda: encoder_case(dict(_SMALL, attention_type="linear"), causal=False, seed=2),
    "encoder_causal_linear": lambda: encoder_case(
        dict(_SMALL, attention_type="causal-linear", final_normalization=False), causal=True, seed=3
    ),
    "decoder_full": lambda: decoder_case(
        dict(_SMALL, self_attention_type="full", cross_attention_type="full"), seed=4
    ),
    "decoder_causal_linear": lambda: decoder_case(
        dict(_SMALL, self_attention_type="causal-linear", cross_attention_type="linear"), seed=5
    ),
    "generator_causal_linear": lambda: generator_case("causal-linear", seed=6),
    "generator_full": lambda: generator_case("full", seed=7),
}


def main():
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, make in CASES.items():
        case = make()
        np.savez_compressed(FIXTURES / f"{name}.npz", **case)
        print(f"wrote {FIXTURES / name}.npz: {len(case)} arrays")


if __name__ == "__main__":
    main()
