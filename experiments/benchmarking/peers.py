"""The authors' library, pytorch-fast-transformers, timed on our benchmarks' shapes in the same run.

A ratio between two systems holds only when both ran in one invocation on one machine, so the
benchmark scripts take `--peers=fast-transformers` and time the peer beside every case of ours:

- attention: their `CausalLinearAttention` (elu+1 feature map, their causal-product kernel,
  normaliser), `FullAttention` under a triangular mask, and `LinearAttention`, on the same
  [B, N, H, D] shapes, forward or forward+backward (gradients of q, k, v for the same
  cotangent).
- generation: their recurrent encoder (`RecurrentEncoderBuilder`, the paper's MNIST architecture:
  8 layers, 8 heads, 256 wide, feed-forward 1024) between an embedding ++ sine/cosine position
  input and a mixture-of-logistics head, with one draw per step as in ours; causal-linear
  attention (the RNN) and full attention (their growing key/value cache).

Install (CPU build, about 10 minutes on 2 cores; with nvcc on the PATH it builds CUDA kernels):
  pip install torch && PATH=<PATH without nvcc> pip install --no-build-isolation \
      pytorch-fast-transformers
Times are medians of repeated calls after a warm-up (`measure.time_call`; torch on the CPU runs
synchronously); peer cases run in float32 only (their CPU kernels have no half precision).
"""

from __future__ import annotations

import math

PEERS = ("fast-transformers",)
# Our attention benchmark kind -> their attention class (and whether it gets a causal mask).
ATTENTION_KINDS = {"causal-linear/chunked": "causal-linear", "softmax": "full", "linear": "linear"}
GENERATION_METHODS = {"linear/recurrent": "causal-linear", "softmax/kv-cache": "full"}
RATIOS_HEADING = "the authors' library in this run (theirs_over_ours > 1: ours is faster)"


def check_peers(peers) -> tuple[str, ...]:
    """The requested peers, each known and importable; otherwise a ValueError saying which and
    how to install it."""
    peers = tuple(peers)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; known: {list(PEERS)}.")
    if peers:
        try:
            import fast_transformers  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"--peers=fast-transformers needs torch and pytorch-fast-transformers importable "
                f"here ({e}); install them (see experiments/benchmarking/peers.py) or leave "
                f"--peers out."
            ) from None
    return peers


def attention_module(name: str, head_dim: int):
    """The authors' attention module for our kind `name` ("causal-linear", "softmax",
    "linear") with per-head width `head_dim` (needs fast_transformers)."""
    from fast_transformers.attention import CausalLinearAttention, FullAttention, LinearAttention

    if name == "causal-linear":
        return CausalLinearAttention(head_dim)
    if name == "linear":
        return LinearAttention(head_dim)
    return FullAttention(attention_dropout=0.0)


def attention_peak_bytes(kind: str, pass_: str, n: int, batch: int, heads: int) -> int:
    """A lower bound on the peer's memory for one case, from its code rather than a run (torch
    has no ahead-of-time figure): their `FullAttention` holds [B, H, N, N] float32 matrices:
    the scores, the masked and scaled scores and their softmax in the forward, and autograd's
    saved softmax and the gradients in the backward (3 and 5 of them). The linear kinds hold
    O(N) arrays, counted as 0."""
    if ATTENTION_KINDS[kind] != "full":
        return 0
    matrices = 3 if pass_ == "forward" else 5
    return matrices * batch * heads * n * n * 4


def attention_call(
    kind: str, pass_: str, n: int, batch: int, heads: int, head_dim: int, value_dim: int, *, seed: int = 0
):
    """One attention case of the peer (float32) as a synchronous call, for `measure.time_call`."""
    import torch
    from fast_transformers.masking import FullMask, LengthMask, TriangularCausalMask

    name = ATTENTION_KINDS[kind]
    torch.manual_seed(seed)
    attention = attention_module(name, head_dim).eval()
    q, k = (torch.randn(batch, n, heads, head_dim) for _ in range(2))
    v, g = (torch.randn(batch, n, heads, value_dim) for _ in range(2))
    mask = TriangularCausalMask(n) if name != "linear" else FullMask(N=n, M=n)
    lengths = LengthMask(torch.full((batch,), n, dtype=torch.int64), max_len=n)

    if pass_ == "forward":

        def call():
            with torch.no_grad():
                attention(q, k, v, mask, lengths, lengths)
    else:
        for x in (q, k, v):
            x.requires_grad_(True)

        def call():
            torch.autograd.grad(attention(q, k, v, mask, lengths, lengths), (q, k, v), g)

    return call


class _Generator:
    """The paper's image generator around their recurrent encoder, one sub-pixel per `step`."""

    def __init__(
        self,
        attention: str,
        *,
        num_layers=8,
        num_heads=8,
        model_dim=256,
        feed_forward_dim=1024,
        num_classes=256,
        num_mixtures=10,
        seed=0,
    ):
        import torch
        from fast_transformers.builders import RecurrentEncoderBuilder

        torch.manual_seed(seed)
        self.encoder = (
            RecurrentEncoderBuilder.from_kwargs(
                n_layers=num_layers,
                n_heads=num_heads,
                query_dimensions=model_dim // num_heads,
                value_dimensions=model_dim // num_heads,
                feed_forward_dimensions=feed_forward_dim,
                attention_type=attention,
                dropout=0.0,
                activation="relu",
            )
            .get()
            .eval()
        )
        self.embed = torch.nn.Embedding(num_classes + 1, model_dim // 2)
        self.head = torch.nn.Linear(model_dim, 3 * num_mixtures)
        self.position_dim = model_dim - model_dim // 2
        self.num_classes, self.num_mixtures = num_classes, num_mixtures
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, self.position_dim, 2) / self.position_dim)
        self.inv_freq = inv_freq

    def step(self, token_B, t: int, state):
        import torch

        angles = t * self.inv_freq
        position = torch.cat([torch.sin(angles), torch.cos(angles)]).expand(len(token_B), -1)
        x_BE = torch.cat([self.embed(token_B), position], dim=-1)
        y_BE, state = self.encoder(x_BE, state=state)
        logit_pi, mean, log_scale = self.head(y_BE).chunk(3, dim=-1)
        # One draw: a component by Gumbel-max, then a logistic sample, as ours per step.
        gumbel = -torch.log(-torch.log(torch.rand_like(logit_pi).clamp_(1e-5, 1 - 1e-5)))
        component = torch.argmax(logit_pi + gumbel, dim=-1, keepdim=True)
        mean = mean.gather(-1, component).squeeze(-1)
        scale = torch.exp(log_scale.gather(-1, component).squeeze(-1).clamp(min=-7.0))
        u = torch.rand_like(mean).clamp_(1e-5, 1 - 1e-5)
        x = mean + scale * (torch.log(u) - torch.log1p(-u))
        value = ((x.clamp(-1, 1) + 1) / 2 * (self.num_classes - 1)).round().long()
        return value, state


def generation_call(method: str, batch: int, length: int, timed_steps: int, *, seed: int = 0):
    """(steps, call): the peer generating `steps` sub-pixels of the MNIST architecture (the first
    `timed_steps`, 0: all, for generation_bench to scale to `length`, as there)."""
    import torch

    name = GENERATION_METHODS[method]
    model = _Generator(name, seed=seed)
    # Their key/value cache grows with every step (torch.cat), so a step's cost grows with t:
    # full attention is timed over the whole image, never scaled from its first steps.
    steps = min(length, timed_steps) if timed_steps and name != "full" else length

    def generate():
        with torch.no_grad():
            token_B = torch.full((batch,), model.num_classes, dtype=torch.long)
            state = None
            for t in range(steps):
                token_B, state = model.step(token_B, t, state)

    return steps, generate


def same_run_ratios(
    rows: list[dict], key_fields: tuple[str, ...], time_field: str, pairs: dict[str, str], kind_field: str
) -> list[dict]:
    """theirs / ours of `time_field` for every case where both ran in these rows (>1: we are
    faster). `pairs` maps our kind to the peer's name."""
    index = {
        tuple(r[f] for f in key_fields) + (r[kind_field],): r
        for r in rows
        if r["status"] == "ok" and math.isfinite(r[time_field])
    }
    out = []
    for key, ours in index.items():
        if key[-1] not in pairs:
            continue
        theirs = index.get(key[:-1] + (f"fast-transformers:{pairs[key[-1]]}",))
        if theirs:
            out.append(
                {
                    **dict(zip(key_fields, key[:-1])),
                    "ours": key[-1],
                    "theirs": theirs[kind_field],
                    f"ours_{time_field}": ours[time_field],
                    f"theirs_{time_field}": theirs[time_field],
                    "theirs_over_ours": theirs[time_field] / ours[time_field],
                }
            )
    return out
