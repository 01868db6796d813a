"""Time to the first new token: one parallel `prefill` of the prompt vs reading it token by token.

  python -m experiments.benchmark_prefill                 # CPU defaults, a few minutes
  python -m experiments.benchmark_prefill --prompt_lengths=512,2048,8192,32768 --batches=1,16 \
      --image_batches=1,64 --out_dir=benchmark_results/prefill_gpu

Language model (CausalLM, untrained, --num_layers x --model_dim, --num_heads heads): a prompt of P
tokens read (a) by `prefill` in one parallel pass then one `step`, (b) by `step` in one compiled
`lax.scan` (the path before prefill); both end with the first new token's logits. Image
completion (the paper's MNIST architecture, untrained): the second half of an image drawn after
its first half is read (a) by `sample_images(prefix=...)`, (b) token by token. Compile time is
excluded from the timings and reported on its own; the ratio b/a comes from the same run.
"""

from absl import app

from experiments.benchmarking import flags, prefill_bench

main = flags.main(
    prefill_bench.PrefillBenchOptions, prefill_bench.run_and_report, out_dir="benchmark_results/prefill"
)

if __name__ == "__main__":
    app.run(main)
