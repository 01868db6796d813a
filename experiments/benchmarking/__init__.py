"""Benchmark library behind the `experiments.benchmark_*` and `experiments.copy_comparison`
entry points.

- `measure`: device-synchronised median timing (compile excluded), XLA's compiled peak memory,
  the memory a run may use, and a description of the machine.
- `attention_bench`: Figure 1 of the paper (time and memory of attention vs sequence length).
- `generation_bench`: images/s of autoregressive generation (recurrent, KV cache, recompute).
- `prefill_bench`: time to first token, one prefill against token by token.
- `sequence_parallel_bench`: memory and step time with time split over devices.
- `gated_bench`: the gated op, what a decay costs.
- `speech_bench`: the speech comparison's table (PER, epoch time, longest utterance).
- `accelerator_bench`: every GPU measurement in one run and one report.
- `copy_bench`: the copy task's runs (paper section 4.1): table, curves and plot.
- `peers`: the authors' library timed on the same cases in the same run.
- `report`: tables on stdout, CSV/JSON files, log-log PNG plots, and `run_and_report`, the run
  and report every benchmark module shares.
- `flags`: an options dataclass's command-line flags, and the entry points' absl `main`.
"""
