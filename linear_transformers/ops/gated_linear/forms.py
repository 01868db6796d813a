"""The four forms of gated (decayed) causal linear attention, by name; all give the same result.

Legend: B batch, T time, H heads, D key/query features, F feature-map features, M value
features, X decay features (1 or F).

Every form is one function with one interface,

  form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc)
      -> (out_BTHM, (s_BHFM, z_BHF))

  q, k, v, g  raw inputs: q, k [B, T, H, D], v [B, T, H, M], log decays g <= 0 [B, T, H, X] or
              None (no decay); `prepare(q, k, v, g, valid_BT)` -> (phi(q) * scale, phi(k), v, g)
              with the keys that do not count zeroed (an `inputs.Preparation`: the pallas form
              applies it inside its kernel where the feature map is pointwise). prepare None: the inputs
              are prepared already (phi(q) and phi(k) [B, T, H, F]), as on a device of a
              sequence axis, which needs them prepared for its totals.
  valid_BT    bool, the keys that count (None: all); read only by `prepare`.
  reset_BT    bool, True where a segment begins: the state is dropped before that step (None:
              none begins).
  s0, z0      the state before the first step (z0 None: no normaliser).
  eps, acc    added to the normaliser; the accumulation dtype.

and computes, with a_t = exp(g_t) and the state dropped at a reset,

  s_t = a_t * s_{t-1} + phi(k_t) v_t^T,   z_t = a_t * z_{t-1} + phi(k_t),
  out_t = phi(q_t) . s_t  (/ (phi(q_t) . z_t + eps) with a normaliser),

returning the outputs and the state after the last step. The pallas form returns a third
value: whether every raw v is finite and every raw log decay <= 0, which its kernel sees as it
loads them (None where XLA prepared them before it), so that the guard need not read them
again. The chunked and pallas forms also take `chunk_size`, which the caller binds.

- "reference": the dense decay matrix (`reference.py`).
- "associative_scan": `lax.associative_scan` of every step's totals (`associative_scan.py`).
- "chunked": chunks, a segment of them at a time (`chunked.py`).
- "scan": the RNN (`scan.py`).
- "pallas": the chunked recurrence as a Pallas kernel (`pallas.py`), which takes `chunk_size`
  as "chunked" does.

Every form carries the non-finite guard (`nonfinite.py`), whichever path calls it: one semantics
for a non-finite value or decay, in the values and in the gradients.
"""

from __future__ import annotations

from linear_transformers.ops.gated_linear import associative_scan, chunked, nonfinite, pallas, reference, scan

FORMS = {
    name: nonfinite.guarded(module.form)
    for name, module in (
        ("reference", reference),
        ("associative_scan", associative_scan),
        ("chunked", chunked),
        ("scan", scan),
        ("pallas", pallas),
    )
}
LINEAR_IMPLEMENTATIONS = tuple(FORMS)
