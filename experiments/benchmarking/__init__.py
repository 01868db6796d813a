"""Benchmark library behind `experiments.benchmark_attention` and `experiments.benchmark_generation`.

- `measure`: device-synchronised median timing (compile excluded), XLA's compiled peak memory,
  the memory a run may use, and a description of the machine.
- `attention_bench`: Figure 1 of the paper (time and memory of attention vs sequence length).
- `generation_bench`: images/s of autoregressive generation (recurrent, KV cache, recompute).
- `report`: tables on stdout, CSV/JSON files, log-log PNG plots.
"""
