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

from absl import app, flags

_LENGTHS = flags.DEFINE_list("prompt_lengths", ["512", "2048", "8192"], "Prompt lengths P.")
_BATCHES = flags.DEFINE_list("batches", ["1", "4"], "Batch sizes of the language-model part.")
_KINDS = flags.DEFINE_list("kinds", ["linear", "softmax"], "Attention kinds: linear, softmax.")
_SOFTMAX_LENGTHS = flags.DEFINE_list(
    "softmax_lengths",
    ["512", "2048"],
    "Prompt lengths softmax runs at (its token-by-token path costs P^2: a KV cache read per step).",
)
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers of the language model.")
_WIDTH = flags.DEFINE_integer("model_dim", 256, "Width of the language model.")
_HEADS = flags.DEFINE_integer("num_heads", 8, "Heads of the language model.")
_VOCAB = flags.DEFINE_integer("vocab_size", 256, "Vocabulary of the language model.")
_IMAGE_ARCH = flags.DEFINE_string(
    "image_arch", "mnist", "Paper architecture for image completion (mnist, cifar10; '' to skip)."
)
_IMAGE_KINDS = flags.DEFINE_list("image_kinds", ["linear", "softmax"], "Kinds for images.")
_IMAGE_BATCHES = flags.DEFINE_list("image_batches", ["1", "16"], "Batch sizes for images.")
_IMAGE_LENGTH = flags.DEFINE_integer(
    "image_length", None, "Sub-pixels per image (default: the architecture's)."
)
_IMAGE_LAYERS = flags.DEFINE_integer(
    "image_layers",
    None,
    "Layers of the image model (default: the architecture's; fewer only for quick tests).",
)
_IMAGE_PREFIX = flags.DEFINE_integer("image_prefix", None, "Given sub-pixels (default: half).")
_MIN_SECONDS = flags.DEFINE_float("min_seconds", 1.0, "Repeat each case for at least this long.")
_DEVICE = flags.DEFINE_enum("device", None, ["cpu", "gpu", "tpu"], "Backend (default: JAX's).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/prefill", "Where CSV/JSON/PNG go.")


def main(argv):
    del argv
    import jax

    if _DEVICE.value:
        jax.config.update("jax_platforms", _DEVICE.value)

    from experiments.training import mesh

    mesh.announce_backend()

    from experiments.benchmarking import prefill_bench

    def ints(values):
        return tuple(int(v) for v in values)

    opts = prefill_bench.PrefillBenchOptions(
        prompt_lengths=ints(_LENGTHS.value),
        batches=ints(_BATCHES.value),
        kinds=tuple(_KINDS.value),
        softmax_lengths=ints(_SOFTMAX_LENGTHS.value),
        num_layers=_LAYERS.value,
        model_dim=_WIDTH.value,
        num_heads=_HEADS.value,
        vocab_size=_VOCAB.value,
        image_arch=_IMAGE_ARCH.value,
        image_kinds=tuple(_IMAGE_KINDS.value),
        image_batches=ints(_IMAGE_BATCHES.value),
        image_length=_IMAGE_LENGTH.value,
        image_layers=_IMAGE_LAYERS.value,
        image_prefix=_IMAGE_PREFIX.value,
        min_seconds=_MIN_SECONDS.value,
    )
    prefill_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
