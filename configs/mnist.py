"""MNIST as in the paper (Table 1): 8 layers, 8 heads x 32 dims, feed-forward 1024, 10 logistics,
RAdam lr 1e-4, batch 16, 250 epochs (937,500 steps). Paper: linear 0.644 bits/dim, softmax 0.621.

Command:
  python -m experiments.train --config configs/mnist.py --workdir workdirs/mnist \
      --config.manual_dir=/path/with/idx/files
  python -m experiments.train --config configs/mnist.py:attention=softmax ...
The raw IDX files (train-images-idx3-ubyte.gz, ...) go in manual_dir, or pass
--config.download=True when online.

Short runs on a CPU (train on part of the test split when only it is at hand:
--config.train_split='test[:9000]' --config.eval_split='test[9000:]'), linear vs softmax:
BENCHMARKS.md, section 7. The paper's numbers need ~937k steps: a GPU job.
"""

from configs import image_base
from experiments.tasks import image_generation


def get_config(arg: str = ""):
    c = image_generation.paper_config("mnist")
    c.batch_size = 16
    c.num_steps = 250 * 60000 // 16
    c.log_every = 100
    c.eval_every = 10000
    c.checkpoint_every = 5000
    c.sample_every = 10000
    c.eval_batch_size = 100
    return image_base.apply(c, arg)
