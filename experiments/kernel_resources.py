"""What the Pallas kernels cost a GPU before they run, on any machine: each kernel of the gated
family compiled by Triton for a GPU (sm_90 by default), with ptxas's registers, spills and shared
memory per decay and launch (value blocks, warps, stages). Needs the `triton` package (dev extra).

  python -m experiments.kernel_resources                                # every decay and launch
  python -m experiments.kernel_resources --decays=step --value_blocks=0 --num_warps=8 --arch=80
  python -m experiments.kernel_resources --normalize --value_blocks=0 --num_warps=8  # elu, normalised
  python -m experiments.kernel_resources --parallel --value_blocks=0 --num_warps=8   # parallel kernels
  python -m experiments.kernel_resources --parallel --walks=4 --value_blocks=0 --num_warps=8  # 4 walks
  python -m experiments.kernel_resources --walks=4 --value_blocks=0 --num_warps=8  # one-pass, 4 walks
  python -m experiments.kernel_resources --split_key_value --value_blocks=0 --num_warps=8  # dk, dv apart
  python -m experiments.kernel_resources --matmul_precision=tensorfloat32  # TF32, not bf16, products

Writes kernel_resources.csv and .md to --out_dir (experiments/benchmarking/kernel_resources.py).
"""

from absl import app

from experiments.benchmarking import flags, kernel_resources

main = flags.main(
    kernel_resources.KernelResourcesOptions,
    kernel_resources.run,
    out_dir="benchmark_results/kernel_resources",
    device=False,
    announce=False,
)

if __name__ == "__main__":
    app.run(main)
