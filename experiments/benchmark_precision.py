"""bfloat16 against float32 for every kind with a recurrent form, beside each model's own
sensitivity to its parameters rounded to bf16.

  python -m experiments.benchmark_precision              # CPU defaults, a few minutes
  python -m experiments.benchmark_precision --lengths=1024,4096 --kinds=gla --device=gpu

Untrained CausalLMs (--num_layers x --model_dim, --num_heads heads); for each kind, length and
seed: the largest logit error of the bf16 parallel and recurrent forms against float32, and of a
float32 run with bf16-rounded parameters (the floor), all over the std of the logits.
"""

from absl import app

from experiments.benchmarking import flags, precision_bench

main = flags.main(
    precision_bench.PrecisionBenchOptions,
    precision_bench.run_and_report,
    out_dir="benchmark_results/precision",
)

if __name__ == "__main__":
    app.run(main)
