"""Multi-query associative recall for several attention kinds: held-out recall against the
number of stored key-value pairs (Zoology's MQAR; BENCHMARKS.md has a run).

  python -m experiments.mqar_comparison                      # six kinds, n = 8, 16, 32, configs/mqar.py
  python -m experiments.mqar_comparison --kinds=linear,deltanet --num_kv_pairs=4,16 \
      --overrides=seq_len=64,num_steps=1200 --out_dir=benchmark_results/mqar_small

Writes mqar.csv/.json/.png and mqar_recall.csv to --out_dir and prints the tables; runs already
finished in --out_dir are read back, not retrained.
"""

from absl import app

from experiments.benchmarking import flags, mqar_bench

main = flags.main(
    mqar_bench.MqarComparisonOptions, mqar_bench.run_and_report, out_dir="benchmark_results/mqar"
)

if __name__ == "__main__":
    app.run(main)
