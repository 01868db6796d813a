"""The guard of the forms that multiply by masked weights ("reference" and "chunked"): run on the
finite part of v, then NaN wherever a step sees a non-finite value, and in the columns of the
final s it reaches (`ops/_nonfinite.py`: otherwise 0 * inf at a masked pair would turn one bad
value into NaN at every step).

Legend: B batch, T time, H heads, F feature-map features, M value features.

The guard wraps the whole chunked form, not just its within-chunk product: a state built from a
non-finite value would still send NaN into earlier steps' gradients (0 * NaN in the backward pass
of later steps' normalisation). The recurrent forms ("associative_scan", "scan") only ever add
what a step can see and need none.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from linear_transformers.ops import _nonfinite


def finite_products(form):
    """`form` (the interface of `forms.py`) with the guard. v is made finite inside `prepare`,
    so the chunked form does that a segment at a time too."""

    @functools.wraps(form)
    def guarded(q, k, v_BTHM, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, **kwargs):
        def prepare_finite(q, k, v, g, valid):
            if prepare is not None:
                q, k, v, g = prepare(q, k, v, g, valid)
            return q, k, _nonfinite.finite_part(v), g

        result = form(q, k, v_BTHM, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, prepare=prepare_finite, **kwargs)
        mark = functools.partial(_mark_seen, v_BTHM, reset_BT, valid_BT)
        return _nonfinite.mark_unless_all_finite(v_BTHM, result, mark)

    return guarded


def _mark_seen(v_BTHM, reset_BT, valid_BT, result):
    """NaN in the outputs (and the columns of the final s) that see a non-finite value of v (of
    the keys that count: `valid_BT`, None: all). Runs only inside the marking branch, so the
    masked copy of v is made only when some value is not finite."""
    if valid_BT is not None:
        v_BTHM = jnp.where(valid_BT[:, :, None, None], v_BTHM, jnp.zeros((), v_BTHM.dtype))
    out_BTHM, (s_BHFM, z_BHF) = result
    seen_BTHM = _nonfinite.seen_nonfinite_BTHM(
        v_BTHM, num_queries=v_BTHM.shape[1], causal=True, reset_BT=reset_BT
    )
    s_BHFM = _nonfinite.mark_seen(s_BHFM, seen_BTHM[:, -1][:, :, None, :])
    return _nonfinite.mark_seen(out_BTHM, seen_BTHM), (s_BHFM, z_BHF)
