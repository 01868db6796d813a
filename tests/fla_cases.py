"""Reference outputs of flash-linear-attention (FLA) for the gated-linear-attention parity tests.

Run with torch, einops and fla-core installed (CPU; `pip install --no-deps fla-core` is enough:
nothing here needs Triton) to regenerate the fixtures the tests read:

    python tests/fla_cases.py              # writes tests/fixtures/fla/*.npz
    python tests/fla_cases.py kda          # only the named cases

FLA's pure-PyTorch references are loaded from their files, not through `import fla` (whose
`__init__` needs Triton):

- fla/ops/simple_gla/naive.py `naive_recurrent_simple_gla(q, k, v, g, scale, initial_state,
  output_final_state)`: q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] (a log decay per head
  and step), S_t = exp(g_t) S_{t-1} + k_t v_t^T with S [B, H, K, V] starting from
  initial_state, o_t = (scale * q_t)^T S_t (scale None: K**-0.5); returns (o [B, T, H, V], S_T).
- fla/ops/gla/naive.py `naive_recurrent_gla(q, k, v, gk, initial_state, output_final_state)`:
  the same with gk [B, T, H, K] (a log decay per key feature and step: S_t = diag(exp(gk_t))
  S_{t-1} + k_t v_t^T) and the scale fixed at K**-0.5.
- fla/ops/retention/naive.py `naive_retention(q, k, v)`: q, k, v [B, H, T, D] (heads before
  time), o_t = sum_{s <= t} gamma_h^(t - s) (D**-0.5 q_t . k_s) v_s with gamma_h = 1 - 2^(-5-h);
  no state in or out.
- fla/ops/delta_rule/naive.py `delta_rule_recurrence(q, k, v, beta, initial_state,
  output_final_state)`: q, k [B, H, T, K] (heads before time), v [B, H, T, V], beta [B, H, T];
  S <- S + k (beta (v - S^T k))^T, o_t = (K**-0.5 q_t)^T S_t.
- fla/ops/gated_delta_rule/naive.py `naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale,
  initial_state, output_final_state)`: [B, T, H, *], g [B, T, H]; S decayed by exp(g_t) first.
- fla/ops/kda/naive.py `naive_recurrent_kda(q, k, v, g, beta, scale, initial_state,
  output_final_state)`: the same with g [B, T, H, K], a decay per key feature.

The delta-rule functions do not normalise q and k (FLA's kernels do, `use_qk_l2norm_in_kernel`):
their cases draw unit-norm q and k, the inputs the op gives them after its own norm.

Each case draws float32 inputs from a fixed seed (a nonzero initial state wherever the function
takes one), runs one function and returns {"meta": json, "input/<name>": ..., "output/<name>":
...} as numpy arrays, inputs and outputs in the layout FLA takes and returns. "meta" names the
function, FLA's version, the layout and the scale. `tests/ops/test_fla_parity.py` compares
`ops.gated_linear_attention` with them; when torch and fla-core are importable it also calls
these functions live on random sizes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib

import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "fla"

# The reference functions by case kind: (file under fla/, function).
FUNCTIONS = {
    "simple_gla": ("ops/simple_gla/naive.py", "naive_recurrent_simple_gla"),
    "gla": ("ops/gla/naive.py", "naive_recurrent_gla"),
    "retention": ("ops/retention/naive.py", "naive_retention"),
    "delta_rule": ("ops/delta_rule/naive.py", "delta_rule_recurrence"),
    "gated_delta_rule": ("ops/gated_delta_rule/naive.py", "naive_recurrent_gated_delta_rule"),
    "kda": ("ops/kda/naive.py", "naive_recurrent_kda"),
}


def _torch():
    import torch

    return torch


def fla_available() -> bool:
    """Whether torch, einops (simple_gla's naive file imports it) and fla-core are installed."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "einops", "fla"))


def _fla_root() -> pathlib.Path:
    """fla's package folder, found without importing it (`fla/__init__` needs Triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed: pip install --no-deps fla-core")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


_LOADED = {}


def naive_function(kind: str):
    """FLA's reference function of `kind`, from its file (loaded once)."""
    if kind not in _LOADED:
        relative, name = FUNCTIONS[kind]
        path = _fla_root() / relative
        spec = importlib.util.spec_from_file_location(f"_fla_naive_{kind}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[kind] = getattr(module, name)
    return _LOADED[kind]


def _meta(kind: str, **fields) -> dict:
    relative, name = FUNCTIONS[kind]
    meta = dict(
        kind=kind,
        function=name,
        file=f"fla/{relative}",
        fla_version=importlib.metadata.version("fla-core"),
        **fields,
    )
    return {"meta": np.array(json.dumps(meta))}


def _numpy(x) -> np.ndarray:
    return x.detach().numpy().copy()


def _draw(generator, batch, length, heads, key_dim, value_dim):
    """q, k [B, T, H, K], v [B, T, H, V] and a nonzero initial state [B, H, K, V]."""
    torch = _torch()
    q = torch.randn(batch, length, heads, key_dim, generator=generator)
    k = torch.randn(batch, length, heads, key_dim, generator=generator)
    v = torch.randn(batch, length, heads, value_dim, generator=generator)
    h0 = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return q, k, v, h0


def _log_gate(generator, shape):
    """log sigmoid(4 + 2 z): mostly mild decays (so the initial state still shows in the final
    state after ~40 steps), with the odd strong one (z = -3: a factor of about 0.12)."""
    torch = _torch()
    return torch.nn.functional.logsigmoid(4.0 + 2.0 * torch.randn(*shape, generator=generator))


def retention_gamma_log(heads: int):
    """log(gamma_h), gamma_h = 1 - 2^(-5 - h) (naive_retention's decays), float32 [H]."""
    torch = _torch()
    return torch.log(1.0 - torch.pow(2.0, -5.0 - torch.arange(heads, dtype=torch.float32)))


def simple_gla_case(
    *, batch=2, length=37, heads=3, key_dim=8, value_dim=8, scale=None, retention=False, seed=0
) -> dict:
    """naive_recurrent_simple_gla from a nonzero initial state, with its final state: g [B, T, H]
    drawn, or (retention=True) RetNet's log(gamma_h), constant over batch and time."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    q, k, v, h0 = _draw(generator, batch, length, heads, key_dim, value_dim)
    if retention:
        g = retention_gamma_log(heads).expand(batch, length, heads).contiguous()
    else:
        g = _log_gate(generator, (batch, length, heads))
    with torch.no_grad():
        o, ht = naive_function("simple_gla")(
            q, k, v, g, scale=scale, initial_state=h0.clone(), output_final_state=True
        )
    return {
        **_meta("simple_gla", layout="BTHD", scale=scale, retention=retention, seed=seed),
        "input/q": _numpy(q),
        "input/k": _numpy(k),
        "input/v": _numpy(v),
        "input/g": _numpy(g),
        "input/initial_state": _numpy(h0),
        "output/o": _numpy(o),
        "output/final_state": _numpy(ht),
    }


def gla_case(*, batch=2, length=37, heads=3, key_dim=8, value_dim=8, seed=0) -> dict:
    """naive_recurrent_gla with gk [B, T, H, K] from a nonzero initial state, with its final
    state (its scale is K**-0.5, fixed)."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    q, k, v, h0 = _draw(generator, batch, length, heads, key_dim, value_dim)
    gk = _log_gate(generator, (batch, length, heads, key_dim))
    with torch.no_grad():
        o, ht = naive_function("gla")(q, k, v, gk, initial_state=h0.clone(), output_final_state=True)
    return {
        **_meta("gla", layout="BTHD", scale=None, seed=seed),
        "input/q": _numpy(q),
        "input/k": _numpy(k),
        "input/v": _numpy(v),
        "input/gk": _numpy(gk),
        "input/initial_state": _numpy(h0),
        "output/o": _numpy(o),
        "output/final_state": _numpy(ht),
    }


def retention_case(*, batch=2, length=37, heads=3, key_dim=8, value_dim=8, seed=0) -> dict:
    """naive_retention on q, k [B, H, T, D], v [B, H, T, V] (its layout; no state)."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, key_dim, generator=generator)
    k = torch.randn(batch, heads, length, key_dim, generator=generator)
    v = torch.randn(batch, heads, length, value_dim, generator=generator)
    with torch.no_grad():
        o = naive_function("retention")(q, k, v)
    return {
        **_meta("retention", layout="BHTD", scale=None, seed=seed),
        "input/q": _numpy(q),
        "input/k": _numpy(k),
        "input/v": _numpy(v),
        "output/o": _numpy(o),
    }


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def delta_rule_case(*, kind, batch=2, length=37, heads=3, key_dim=8, value_dim=6, scale=None, seed=0) -> dict:
    """One of FLA's delta-rule references from a nonzero initial state, with its final state:
    unit-norm q and k, beta = sigmoid(z) [B, T, H], and for the gated kinds g [B, T, H]
    (gated_delta_rule) or [B, T, H, K] (kda). Inputs and outputs are stored [B, T, H, *]."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    q, k, v, h0 = _draw(generator, batch, length, heads, key_dim, value_dim)
    q, k = _unit(q), _unit(k)
    beta = torch.sigmoid(torch.randn(batch, length, heads, generator=generator))
    g = None
    with torch.no_grad():
        if kind == "delta_rule":
            to_bhtd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
            o, ht = naive_function(kind)(
                to_bhtd(q),
                to_bhtd(k),
                to_bhtd(v),
                to_bhtd(beta),
                initial_state=h0.clone(),
                output_final_state=True,
            )
            o = o.transpose(1, 2)
        else:
            g = _log_gate(
                generator,
                (batch, length, heads) if kind == "gated_delta_rule" else (batch, length, heads, key_dim),
            )
            arguments = (q, k, v, beta, g) if kind == "gated_delta_rule" else (q, k, v, g, beta)
            o, ht = naive_function(kind)(
                *arguments, scale=scale, initial_state=h0.clone(), output_final_state=True
            )
    gate = {} if g is None else {"input/g": _numpy(g)}
    return {
        **_meta(kind, layout="BTHD", scale=scale, seed=seed),
        "input/q": _numpy(q),
        "input/k": _numpy(k),
        "input/v": _numpy(v),
        "input/beta": _numpy(beta),
        **gate,
        "input/initial_state": _numpy(h0),
        "output/o": _numpy(o),
        "output/final_state": _numpy(ht),
    }


# The delta-rule cases (`delta_rule_case`); the others are the gated family's.
DELTA_CASES = ("delta_rule", "gated_delta_rule", "kda")

CASES = {
    "simple_gla": lambda: simple_gla_case(seed=0),
    # V != K, an explicit scale.
    "simple_gla_scaled": lambda: simple_gla_case(value_dim=5, scale=0.3, seed=1),
    "gla": lambda: gla_case(seed=2),
    "gla_wide_values": lambda: gla_case(value_dim=12, seed=3),
    "retention": lambda: retention_case(seed=4),
    # Retention from an initial state: simple GLA with g = log(gamma_h) at every step.
    "retention_simple_gla": lambda: simple_gla_case(retention=True, seed=5),
    "delta_rule": lambda: delta_rule_case(kind="delta_rule", seed=6),
    "gated_delta_rule": lambda: delta_rule_case(kind="gated_delta_rule", scale=0.3, seed=7),
    "kda": lambda: delta_rule_case(kind="kda", seed=8),
}


def main(names=()):
    """Write the cases `names` (all of them when empty) to tests/fixtures/fla/<name>.npz."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, make in CASES.items():
        if names and name not in names:
            continue
        case = make()
        path = FIXTURES / f"{name}.npz"
        np.savez_compressed(path, **case)
        print(f"wrote {path}: {len(case)} arrays, {path.stat().st_size} bytes")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
