"""What a decay costs: gated linear attention with each shape of log decay vs plain causal linear.

  python -m experiments.benchmark_gated                       # CPU defaults, N = 4096 and 16384
  python -m experiments.benchmark_gated --dtype=bfloat16 --lengths=4096,16384,65536 --out_dir=bench/gpu
  python -m experiments.benchmark_gated --decays=step,feature --impls=chunked --chunk_size=32

Cases: causal-linear/chunked (`ops.causal_linear_attention`, the baseline) and
gated-{none,head,step,feature}/{chunked,quadratic} (`ops.gated_linear_attention` with no decay,
a decay per head [H], per head and step [B, N, H], or per key feature and step [B, N, H, D];
"quadratic" is the dense reference, run where it fits in memory). Forward and forward+backward
(gradients of q, k, v and the log decay), median of repeats, compile excluded; every time is also
given over the baseline's in the same run, against the goal that a decay costs at most 1.3x plain
causal linear forward+backward.
"""

from absl import app, flags

_LENGTHS = flags.DEFINE_list("lengths", ["4096", "16384"], "Sequence lengths N.")
_TOKENS = flags.DEFINE_integer("tokens", 4096, "Batch = max(1, tokens // N), unless --batch is set.")
_BATCH = flags.DEFINE_integer("batch", None, "Batch B at every N (default: from --tokens).")
_HEADS = flags.DEFINE_integer("heads", 8, "Heads H.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Query/key features per head D.")
_VALUE_DIM = flags.DEFINE_integer("value_dim", 64, "Value features per head M.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype (decays: float32).")
_DECAYS = flags.DEFINE_list(
    "decays", ["none", "head", "step", "feature"], "Log decay shapes: none, head, step, feature."
)
_IMPLS = flags.DEFINE_list(
    "impls", ["chunked", "quadratic"], "Forms of the gated op: chunked, quadratic (dense reference)."
)
_PASSES = flags.DEFINE_list("passes", ["forward", "forward+backward"], "forward, forward+backward.")
_CHUNK = flags.DEFINE_integer(
    "chunk_size", None, "Chunk length of the chunked forms (default: the op's, 64)."
)
_BIAS = flags.DEFINE_float(
    "decay_logit_bias", 3.0, "Log decays = log_sigmoid(normal logits + this); 3: ~0.95 kept per step."
)
_MEMORY = flags.DEFINE_float("memory_fraction", 0.6, "Fraction of free device memory per case.")
_MAX_CALL = flags.DEFINE_float(
    "max_call_seconds", 5.0, "Stop growing N for a case once one call takes longer."
)
_MIN_SECONDS = flags.DEFINE_float("min_seconds", 0.5, "Repeat each case for at least this long.")
_DEVICE = flags.DEFINE_enum("device", None, ["cpu", "gpu", "tpu"], "Backend (default: JAX's).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/gated", "Where CSV/JSON/PNG go.")


def main(argv):
    del argv
    import jax

    if _DEVICE.value:
        jax.config.update("jax_platforms", _DEVICE.value)

    from experiments.training import mesh

    mesh.announce_backend()

    from experiments.benchmarking import gated_bench

    opts = gated_bench.GatedBenchOptions(
        lengths=tuple(int(n) for n in _LENGTHS.value),
        tokens=_TOKENS.value,
        batch=_BATCH.value,
        heads=_HEADS.value,
        head_dim=_HEAD_DIM.value,
        value_dim=_VALUE_DIM.value,
        dtype=_DTYPE.value,
        decays=tuple(_DECAYS.value),
        impls=tuple(_IMPLS.value),
        passes=tuple(_PASSES.value),
        chunk_size=_CHUNK.value,
        decay_logit_bias=_BIAS.value,
        memory_fraction=_MEMORY.value,
        max_call_seconds=_MAX_CALL.value,
        min_seconds=_MIN_SECONDS.value,
    )
    gated_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
