"""`ops.gated_linear_attention` gives flash-linear-attention's (FLA's) outputs and final states.

Fixtures in tests/fixtures/fla/ were written by tests/fla_cases.py with FLA's pure-PyTorch
references (`naive_recurrent_simple_gla`, `naive_recurrent_gla`, `naive_retention`): their
inputs, initial states, outputs and final states. Every impl of ours (and the recurrent step,
scanned) reproduces them within 1e-5 (float32), with the decay shape that matches each:

| FLA                                   | our log_decay                         |
| ------------------------------------- | ------------------------------------- |
| simple GLA, g [B, T, H]               | g, [B, T, H]                          |
| GLA, gk [B, T, H, K]                  | gk, [B, T, H, K]                      |
| retention, gamma_h = 1 - 2^(-5-h)     | `retention_log_decay(H)`, [H]         |

Conventions are the same: the decay of step t applies before step t adds k_t v_t^T, the scale
(K**-0.5 unless given) multiplies q, and the state is [B, H, K, V] (ours: s [B, H, F, M]), so
FLA's initial and final states are our `LinearState(s, None)` as they are. FLA's layout
[B, T, H, D] is ours; only naive_retention takes [B, H, T, D]. When torch and fla-core are
importable, the same cases also run live on random sizes.
"""

from __future__ import annotations

import json

import fla_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.attention import retention_log_decay

# float32 agreement, with float32 matrix products on every platform (TF32 on a GPU would
# part ours from FLA's by ~1e-3: tests/ops/test_default_precision.py covers that precision).
pytestmark = pytest.mark.usefixtures("float32_products")
ATOL = 1e-5
# Outputs reach ~16 in the fixtures and ~30 at live sizes (retention's slowest decay over ~90
# steps), where float32 rounding alone parts ours from FLA's by more than 1e-5 (by 1.3e-5 at
# T = 84, each within 9e-6 of a float64 recurrence; on an H200, 1.7e-5 of 16.2 in a fixture,
# its GPU summing in another order): the tolerance grows by 1e-6 of the value.
RTOL = 1e-6
FIXTURE_NAMES = sorted(p.stem for p in cases.FIXTURES.glob("*.npz"))
GATED_NAMES = [name for name in FIXTURE_NAMES if name not in cases.DELTA_CASES]
# Every impl; the chunked one with chunks that do not divide T (16) and with its default; the
# GPU kernel (interpreted on a CPU) with its default.
IMPLS = [
    ("reference", None),
    ("associative_scan", None),
    ("scan", None),
    ("chunked", 16),
    ("chunked", None),
    ("pallas", None),
]


def _load(name: str) -> dict:
    with np.load(cases.FIXTURES / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def _meta(case: dict) -> dict:
    return json.loads(str(case["meta"]))


def _to_ours(case: dict):
    """(q, k, v [B, T, H, *], log_decay, initial LinearState or None, scale, expected out
    [B, T, H, V], expected final s [B, H, K, V] or None) of a fixture."""
    meta = _meta(case)
    q, k, v = (case[f"input/{n}"] for n in "qkv")
    out = case["output/o"]
    if meta["layout"] == "BHTD":  # naive_retention: heads before time
        q, k, v, out = (np.swapaxes(x, 1, 2) for x in (q, k, v, out))
    H = q.shape[2]
    if meta["kind"] == "retention" or meta.get("retention"):
        log_decay = retention_log_decay(H)
        if "input/g" in case:  # simple GLA fed log(gamma_h) at every step: the same constants
            np.testing.assert_allclose(
                case["input/g"], np.broadcast_to(log_decay, case["input/g"].shape), rtol=1e-6
            )
    else:
        log_decay = case["input/gk"] if meta["kind"] == "gla" else case["input/g"]
    h0 = case.get("input/initial_state")
    state = None if h0 is None else ops.LinearState(jnp.asarray(h0), None)
    return q, k, v, log_decay, state, meta["scale"], out, case.get("output/final_state")


# Compiled once per shape (op by op, the associative scan alone takes seconds to dispatch).
_attend = jax.jit(
    ops.gated_linear_attention, static_argnames=("scale", "implementation", "chunk_size", "return_state")
)


def check_parallel(case: dict, impl: str, chunk_size=None, *, log_decay=None):
    q, k, v, g, state, scale, expected, final = _to_ours(case)
    out, new_state = _attend(
        q,
        k,
        v,
        log_decay=g if log_decay is None else log_decay,
        scale=scale,
        implementation=impl,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=True,
    )
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=RTOL)
    assert new_state.z_BHF is None
    if final is not None:
        np.testing.assert_allclose(new_state.s_BHFM, final, atol=ATOL, rtol=RTOL)


def check_steps(case: dict):
    """`gated_linear_attention_step` scanned over T from the fixture's initial state."""
    q, k, v, g, state, scale, expected, final = _to_ours(case)
    B, T, H, D = q.shape
    if state is None:
        state = ops.init_linear_state(B, H, D, v.shape[-1], normalizer=False)
    g = jnp.asarray(g)
    per_step = g.ndim > 1  # [B, T, H(, K)]: the step's slice; [H]: the same every step

    def step(state, xs):
        q_t, k_t, v_t, g_t = xs
        return ops.gated_linear_attention_step(
            state, q_t, k_t, v_t, log_decay=g_t if per_step else g, scale=scale
        )

    xs = tuple(jnp.swapaxes(jnp.asarray(x), 0, 1) for x in (q, k, v)) + (
        jnp.swapaxes(g, 0, 1) if per_step else jnp.zeros((T,)),
    )
    new_state, out_TBHM = jax.lax.scan(step, state, xs)
    np.testing.assert_allclose(jnp.swapaxes(out_TBHM, 0, 1), expected, atol=ATOL, rtol=RTOL)
    if final is not None:
        np.testing.assert_allclose(new_state.s_BHFM, final, atol=ATOL, rtol=RTOL)


def test_every_fixture_is_present_and_names_its_function():
    assert FIXTURE_NAMES == sorted(cases.CASES)
    functions = {_meta(_load(n))["function"] for n in FIXTURE_NAMES}
    assert functions == {name for _, name in cases.FUNCTIONS.values()}
    for name in FIXTURE_NAMES:
        case = _load(name)
        assert _meta(case)["fla_version"]
        # A nonzero initial state wherever FLA takes one, and T not a multiple of a chunk.
        if _meta(case)["kind"] != "retention":
            assert np.abs(case["input/initial_state"]).min() > 0
        assert case["output/o"].shape[1 if _meta(case)["layout"] == "BTHD" else 2] % 16


@pytest.mark.parametrize("impl, chunk_size", IMPLS, ids=[f"{i}-{c}" for i, c in IMPLS])
@pytest.mark.parametrize("name", GATED_NAMES)
def test_every_impl_gives_flas_outputs_and_final_state(name, impl, chunk_size):
    check_parallel(_load(name), impl, chunk_size)


@pytest.mark.parametrize("name", GATED_NAMES)
def test_the_recurrent_step_gives_flas_outputs_and_final_state(name):
    check_steps(_load(name))


def test_retention_as_a_literal_constant_per_head_or_per_step():
    # RetNet's gamma_h written out rather than through retention_log_decay, and broadcast to
    # [B, T, H] and to [B, T, H, K]: the same outputs.
    case = _load("retention_simple_gla")
    B, T, H, K = case["input/q"].shape
    gamma = 1.0 - 2.0 ** (-5.0 - np.arange(H))
    for log_decay in (
        np.log(gamma).astype(np.float32),
        case["input/g"],
        np.broadcast_to(case["input/g"][..., None], (B, T, H, K)),
    ):
        check_parallel(case, "chunked", 16, log_decay=log_decay)
    retention = _load("retention")
    check_parallel(retention, "reference", log_decay=np.log(gamma).astype(np.float32))


def _slipped(case: dict, slip: str) -> dict:
    """`case` with its inputs read under a wrong convention (expected outputs unchanged)."""
    g_key = "input/gk" if "input/gk" in case else "input/g"
    g, h0 = case[g_key], case["input/initial_state"]
    T = g.shape[1]
    slipped = {
        # the decay of step t applied after step t adds its key (g one step late)
        "decay after the key": {g_key: np.concatenate([np.zeros_like(g[:, :1]), g[:, :-1]], axis=1)},
        # one decay off by 1e-3
        "one decay": {g_key: g - 1e-3 * (np.arange(T) == T // 2).reshape((1, T) + (1,) * (g.ndim - 2))},
        # the state read as [B, H, V, K] (K = V here, so the shape fits)
        "state transposed": {"input/initial_state": np.swapaxes(h0, -1, -2)},
        # GLA's per-key decays put on the wrong key features
        "decays on other features": {g_key: g[..., ::-1]},
        # scale 1 rather than FLA's K**-0.5
        "no scale": {"meta": np.array(json.dumps(dict(_meta(case), scale=1.0)))},
    }[slip]
    return dict(case, **slipped)


@pytest.mark.parametrize(
    "name, slip",
    [
        ("simple_gla", "decay after the key"),
        ("simple_gla", "one decay"),
        ("simple_gla", "state transposed"),
        ("simple_gla", "no scale"),
        ("gla", "decay after the key"),
        ("gla", "decays on other features"),
        ("gla", "state transposed"),
        ("retention_simple_gla", "state transposed"),
    ],
)
def test_the_comparison_sees_a_slip_in_the_conventions(name, slip):
    # Each would pass if the tolerance or the checks were too loose to tell the conventions apart.
    with pytest.raises(AssertionError):
        check_parallel(_slipped(_load(name), slip), "scan")


@pytest.mark.parametrize("key", ["output/o", "output/final_state"])
def test_one_expected_value_off_by_twice_the_tolerance_is_seen(key):
    case = _load("gla")
    case[key] = case[key].copy()
    index = (1, -1, 2, 3)
    case[key][index] += 2 * (ATOL + RTOL * abs(case[key][index]))
    with pytest.raises(AssertionError):
        check_parallel(case, "chunked", 16)
    with pytest.raises(AssertionError):
        check_steps(case)


# --- live, with FLA ------------------------------------------------------------------------------


def _live():
    pytest.importorskip("torch", reason="torch not installed: the fixtures above cover the comparison")
    if not cases.fla_available():
        pytest.skip("fla-core (and einops) not installed: the fixtures above cover the comparison")


LIVE_CASES = {
    "simple_gla": lambda scale, **sizes: cases.simple_gla_case(scale=scale, **sizes),
    "gla": lambda scale, **sizes: cases.gla_case(**sizes),
    "retention": lambda scale, **sizes: cases.retention_case(**sizes),
    "retention_simple_gla": lambda scale, **sizes: cases.simple_gla_case(retention=True, **sizes),
}


@pytest.mark.parametrize("kind", sorted(LIVE_CASES))
@pytest.mark.parametrize("seed", range(3))
def test_live_random_sizes_match_fla(seed, kind):
    _live()
    rng = np.random.default_rng(100 + seed)
    sizes = dict(
        batch=int(rng.integers(1, 4)),
        length=int(rng.integers(1, 90)),
        heads=int(rng.integers(1, 5)),
        key_dim=int(rng.integers(1, 17)),
        value_dim=int(rng.integers(1, 17)),
        seed=1000 + seed,
    )
    scale = float(rng.uniform(0.1, 1.0)) if seed else None
    case = LIVE_CASES[kind](scale, **sizes)
    for impl, chunk_size in IMPLS:
        try:
            check_parallel(case, impl, chunk_size)
        except AssertionError as error:
            raise AssertionError(f"{kind} {impl} chunk_size={chunk_size} at {sizes}") from error
    check_steps(case)


# --- the delta rule: delta_rule_recurrence, naive_recurrent_gated_delta_rule, naive_recurrent_kda


def _delta_inputs(case: dict):
    """(q, k, v, beta, log_decay or None, initial LinearState, scale) of a delta-rule fixture: its
    q and k are unit-norm already (FLA's naive functions do not normalise), so ours runs with
    qk_l2norm=False on them."""
    q, k, v, beta = (jnp.asarray(case[f"input/{n}"]) for n in ("q", "k", "v", "beta"))
    g = case.get("input/g")
    state = ops.LinearState(jnp.asarray(case["input/initial_state"]), None)
    return q, k, v, beta, None if g is None else jnp.asarray(g), state, _meta(case)["scale"]


DELTA_IMPLS = [("reference", None), ("scan", None), ("chunked", 16), ("chunked", None)]


@pytest.mark.parametrize("impl, chunk_size", DELTA_IMPLS, ids=[f"{i}-{c}" for i, c in DELTA_IMPLS])
@pytest.mark.parametrize("name", cases.DELTA_CASES)
def test_every_delta_rule_impl_gives_flas_outputs_and_final_state(name, impl, chunk_size):
    case = _load(name)
    q, k, v, beta, g, state, scale = _delta_inputs(case)
    out, new_state = ops.delta_rule_attention(
        q, k, v, beta, log_decay=g, scale=scale, qk_l2norm=False, implementation=impl,
        chunk_size=chunk_size, initial_state=state, return_state=True,
    )  # fmt: skip
    np.testing.assert_allclose(out, case["output/o"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(new_state.s_BHFM, case["output/final_state"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", cases.DELTA_CASES)
def test_the_delta_rule_step_gives_flas_outputs_and_final_state(name):
    case = _load(name)
    q, k, v, beta, g, state, scale = _delta_inputs(case)

    def step(state, xs):
        q_t, k_t, v_t, beta_t, g_t = xs
        return ops.delta_rule_attention_step(
            state, q_t, k_t, v_t, beta_t, log_decay=g_t, scale=scale, qk_l2norm=False
        )

    xs = tuple(None if x is None else jnp.swapaxes(x, 0, 1) for x in (q, k, v, beta, g))
    new_state, out_TBHM = jax.lax.scan(step, state, xs)
    np.testing.assert_allclose(jnp.swapaxes(out_TBHM, 0, 1), case["output/o"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(new_state.s_BHFM, case["output/final_state"], atol=ATOL, rtol=RTOL)
