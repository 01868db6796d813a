"""Sample images from a trained workdir.

  python -m experiments.sample --workdir workdirs/digits --num_images 64
  python -m experiments.sample --workdir workdirs/digits --prefix_pixels 32   # complete test images
  python -m experiments.sample --workdir workdirs/digits --method recompute   # the paper's baseline

--method recurrent (default) runs the model as an RNN in one compiled `lax.scan`: the (S, z)
state for linear attention, a preallocated KV cache for softmax. --method recompute runs the
parallel model over the whole prefix for every sub-pixel (how softmax generation is done
without a cache). Writes a PNG grid and prints images/s.
"""

from absl import app, flags

from experiments.cli import one_line_errors
from experiments.training.sampling import sample_from_workdir

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (config.json, checkpoints/).",
                               required=True)
_NUM = flags.DEFINE_integer("num_images", 16, "How many images.")
_PREFIX = flags.DEFINE_integer("prefix_pixels", 0,
                               "Condition on the first k sub-pixels of test images (0: none).")
_METHOD = flags.DEFINE_enum("method", "recurrent", ["recurrent", "recompute"], "How to generate.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_OUT = flags.DEFINE_string("out", None, "PNG path (default: <workdir>/samples/sample_*.png).")


@one_line_errors
def main(argv):
    del argv
    result = sample_from_workdir(_WORKDIR.value, num_images=_NUM.value,
                                 prefix_pixels=_PREFIX.value, method=_METHOD.value,
                                 seed=_SEED.value, step=_STEP.value, out=_OUT.value)
    print(f"wrote {result['path']}: {result['num_images']} images in {result['seconds']:.2f} s, "
          f"{result['images_per_sec']:.2f} images/s ({result['method']}, step {result['step']})")


if __name__ == "__main__":
    app.run(main)
