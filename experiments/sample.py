"""Sample images from a trained workdir, or from a model trained with the authors' library.

  python -m experiments.sample --workdir workdirs/digits --num_images 64
  python -m experiments.sample --workdir workdirs/digits --prefix_pixels 32   # complete test images
  python -m experiments.sample --workdir workdirs/digits --method recompute   # the paper's baseline

  # The authors' MNIST demo models (pytorch-fast-transformers state dicts, .pth or .npz):
  python -m experiments.sample --fast_transformers_checkpoint linear.pth --attention_type linear \
      --prefix_pixels 1 --manual_dir ../shared/data/mnist

--method recurrent (default) runs the model as an RNN in one compiled `lax.scan`: the (S, z)
state for linear attention, a preallocated KV cache for softmax. --method recompute runs the
parallel model over the whole prefix for every sub-pixel (how softmax generation is done
without a cache). Writes a PNG grid and prints images/s.
"""

from absl import app, flags

from experiments.cli import one_line_errors, stop_at_once_on_interrupt
from experiments.tasks.image_sampling import sample_from_fast_transformers, sample_from_workdir
from experiments.training import mesh

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (config.json, checkpoints/).")
_CHECKPOINT = flags.DEFINE_string(
    "fast_transformers_checkpoint",
    None,
    "Instead of --workdir: the state dict of the authors' demo Generator / RecurrentGenerator "
    "(.pth, read with torch, or .npz of the same arrays).",
)
_ATTENTION = flags.DEFINE_enum(
    "attention_type",
    "linear",
    ["linear", "causal-linear", "full"],
    "With --fast_transformers_checkpoint: the model's attention.",
)
_HEADS = flags.DEFINE_integer(
    "n_heads", 8, "With --fast_transformers_checkpoint: its heads (the demo's models have 8)."
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir", "~/tensorflow_datasets", "With --fast_transformers_checkpoint: TFDS data_dir for MNIST."
)
_MANUAL_DIR = flags.DEFINE_string(
    "manual_dir",
    None,
    "With --fast_transformers_checkpoint: the "
    "folder of MNIST's IDX files (default <data_dir>/downloads/manual).",
)
_NUM = flags.DEFINE_integer("num_images", 16, "How many images.")
_PREFIX = flags.DEFINE_integer(
    "prefix_pixels",
    None,
    "Condition on the first k sub-pixels of test images (default: 0 "
    "with --workdir, 1 with --fast_transformers_checkpoint).",
)
_METHOD = flags.DEFINE_enum("method", "recurrent", ["recurrent", "recompute"], "How to generate.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_OUT = flags.DEFINE_string(
    "out",
    None,
    "PNG path (default: <workdir>/samples/sample_*.png, or <checkpoint name>_<method>_k<prefix>.png here).",
)


@one_line_errors
def main(argv):
    del argv
    with stop_at_once_on_interrupt():  # nothing to save: Ctrl-C stops even mid-compile
        if (_WORKDIR.value is None) == (_CHECKPOINT.value is None):
            raise ValueError(
                "give exactly one of --workdir (a training run) and "
                "--fast_transformers_checkpoint (a model of the authors' library)."
            )
        mesh.announce_backend()
        if _CHECKPOINT.value is not None:
            result = sample_from_fast_transformers(
                _CHECKPOINT.value,
                attention_type=_ATTENTION.value,
                n_heads=_HEADS.value,
                num_images=_NUM.value,
                prefix_pixels=1 if _PREFIX.value is None else _PREFIX.value,
                method=_METHOD.value,
                seed=_SEED.value,
                out=_OUT.value,
                data_dir=_DATA_DIR.value,
                manual_dir=_MANUAL_DIR.value,
            )
            source = f"{_CHECKPOINT.value}, {_ATTENTION.value} attention"
        else:
            result = sample_from_workdir(
                _WORKDIR.value,
                num_images=_NUM.value,
                prefix_pixels=_PREFIX.value or 0,
                method=_METHOD.value,
                seed=_SEED.value,
                step=_STEP.value,
                out=_OUT.value,
            )
            source = f"step {result['step']}"
        print(
            f"wrote {result['path']}: {result['num_images']} images in {result['seconds']:.2f} s, "
            f"{result['images_per_sec']:.2f} images/s ({result['method']}, {source})"
        )


if __name__ == "__main__":
    app.run(main)
