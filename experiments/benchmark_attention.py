"""Time and peak memory of attention vs sequence length: the paper's Figure 1.

  python -m experiments.benchmark_attention                       # CPU defaults, a few minutes
  python -m experiments.benchmark_attention --dtype=bfloat16 --tokens=65536 --out_dir=bench/gpu
  python -m experiments.benchmark_attention --lengths=1024,4096 --kinds=softmax,causal-linear/chunked
  python -m experiments.benchmark_attention --peers=fast-transformers   # the authors' library too

Kinds: softmax (XLA, causal), softmax-cudnn (cuDNN flash attention, GPU, half precision),
causal-linear/{chunked,associative_scan,scan}, linear (non-causal). Forward and forward+backward,
median of repeats, compile excluded; peak memory is XLA's figure for the compiled call. The batch
shrinks as N grows (B = max(1, tokens // N)); the plot shows results per sample. Cases over the
memory budget are skipped and listed with what they would need. `--peers=fast-transformers`
times the authors' library on the same cases in the same run and prints theirs / ours.
"""

from absl import app, flags

_LENGTHS = flags.DEFINE_list("lengths", [str(2**p) for p in range(9, 17)], "Sequence lengths N.")
_TOKENS = flags.DEFINE_integer("tokens", 4096, "Batch = max(1, tokens // N).")
_HEADS = flags.DEFINE_integer("heads", 8, "Heads H.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Query/key features per head D.")
_VALUE_DIM = flags.DEFINE_integer("value_dim", 64, "Value features per head M.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Input dtype.")
_KINDS = flags.DEFINE_list(
    "kinds",
    [],
    "Kinds to run (default: all this device can run, but the opt-in LSH baselines lsh-1, lsh-4, lsh-8).",
)
_PASSES = flags.DEFINE_list("passes", ["forward", "forward+backward"], "forward, forward+backward.")
_CHUNK = flags.DEFINE_integer(
    "chunk_size",
    None,
    "Chunk length of the chunked form (default: the library's choice for the device and dtype).",
)
_MEMORY = flags.DEFINE_float("memory_fraction", 0.6, "Fraction of free device memory per case.")
_MAX_CALL = flags.DEFINE_float(
    "max_call_seconds", 5.0, "Stop growing N for a kind once one call takes longer."
)
_MIN_SECONDS = flags.DEFINE_float("min_seconds", 0.5, "Repeat each case for at least this long.")
_DEVICE = flags.DEFINE_enum("device", None, ["cpu", "gpu", "tpu"], "Backend (default: JAX's).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/attention", "Where CSV/JSON/PNG go.")
_PEERS = flags.DEFINE_list(
    "peers",
    [],
    "Also time these libraries on the same cases, in this "
    "run: fast-transformers (the authors'; needs torch and "
    "pytorch-fast-transformers importable).",
)


def main(argv):
    del argv
    import jax

    if _DEVICE.value:
        jax.config.update("jax_platforms", _DEVICE.value)

    from experiments.training import mesh

    mesh.announce_backend()

    from experiments.benchmarking import attention_bench
    from linear_transformers import ops

    chunk = _CHUNK.value or ops.DEFAULT_CHUNK_SIZE
    opts = attention_bench.AttentionBenchOptions(
        lengths=tuple(int(n) for n in _LENGTHS.value),
        tokens=_TOKENS.value,
        heads=_HEADS.value,
        head_dim=_HEAD_DIM.value,
        value_dim=_VALUE_DIM.value,
        dtype=_DTYPE.value,
        kinds=tuple(_KINDS.value),
        passes=tuple(_PASSES.value),
        chunk_size=chunk,
        memory_fraction=_MEMORY.value,
        max_call_seconds=_MAX_CALL.value,
        min_seconds=_MIN_SECONDS.value,
        peers=tuple(_PEERS.value),
    )
    attention_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
