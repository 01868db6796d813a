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

from absl import app

from experiments.benchmarking import attention_bench, flags

main = flags.main(
    attention_bench.AttentionBenchOptions,
    attention_bench.run_and_report,
    out_dir="benchmark_results/attention",
)

if __name__ == "__main__":
    app.run(main)
