"""Every key each trainer reads, with its default: the trainers' own schemas.

A config for a trainer holds exactly these keys (the trainer rejects any other, so a typo in a
config or an override fails loudly instead of being ignored) with values of the defaults' types.
The experiment configs in `configs/` start from these and change what differs.
"""

import ml_collections


def image_generation() -> ml_collections.ConfigDict:
    """The image-generation trainer's keys (`experiments.training.loop`)."""
    c = ml_collections.ConfigDict()
    c.task = "image_generation"  # which trainer runs the config (configs/copy.py: "copy")
    c.seed = 0

    # Data: a name from experiments.data, where prepared data lives, where raw files are.
    c.dataset = "digits"
    c.data_dir = "~/tensorflow_datasets"
    c.manual_dir = ""  # raw files (IDX .gz, cifar-10-batches-py); "" = <data_dir>/downloads/manual
    c.download = False  # fetch raw files with the TFDS download manager when missing
    c.train_split = "train"  # "train", "test", or a slice such as "test[:9000]"
    c.eval_split = "test"
    c.max_train_examples = 0  # 0 = all; >0 keeps the first N (quick runs)
    c.max_eval_examples = 0  # 0 = the whole test split

    # Model: the paper's image generator (embedding ++ positions, causal transformer, mixture).
    c.attention = "linear"  # any registered kind: linear, causal-linear, softmax
    c.attention_options = ml_collections.ConfigDict()
    c.num_layers = 8
    c.num_heads = 8
    c.model_dim = 256
    c.feed_forward_dim = 1024
    c.dropout = 0.1
    c.attention_dropout = 0.0
    c.softmax_temp = 0.0  # 0 = 1/sqrt(head dim); softmax only
    c.num_mixtures = 10
    c.dtype = "float32"  # computation: float32 | bfloat16 (parameters stay float32)

    # Optimisation.
    c.optimizer = "radam"  # radam | adamw
    c.learning_rate = 1e-4
    c.schedule = "constant"  # constant | cosine (to 0 at num_steps) | step
    c.decay_steps = 0  # schedule "step": multiply the rate by decay_factor from here
    c.decay_factor = 0.1
    c.warmup_steps = 0
    c.weight_decay = 0.01
    c.grad_clip = 1.0  # global norm; 0 = off
    c.batch_size = 16
    c.num_steps = 1000

    # Bookkeeping (0 = never, except at the end of the run).
    c.log_every = 50
    c.eval_every = 500
    c.eval_batch_size = 64
    c.checkpoint_every = 500
    c.keep_checkpoints = 2
    c.sample_every = 500
    c.num_samples = 16
    c.progress_bar = True

    # Devices: a ("data", "sequence") mesh whose sizes multiply to the device count.
    # sequence > 1 splits every image's sub-pixel axis over that many devices (sequence
    # parallelism: attention kinds linear, causal-linear, softmax; it must divide H*W*C);
    # data = batch split (data parallel), -1 = the devices left over. E.g. on 8 devices
    # --config.mesh.sequence=4 gives data=2 x sequence=4.
    c.mesh = ml_collections.ConfigDict({"data": -1, "sequence": 1})
    c.distributed = False  # jax.distributed.initialize() for multi-host runs
    return c


def copy_task() -> ml_collections.ConfigDict:
    """The copy-task trainer's keys (`experiments.training.copy_loop`), at the paper's setting."""
    c = ml_collections.ConfigDict()
    c.task = "copy"
    c.seed = 0

    # Data: n symbols, n uniform in [max_length // 4, (max_length - 1) // 2).
    c.max_length = 128
    c.num_symbols = 10

    # Model: "decoder" (the paper's) or "encoder_decoder" (the replication's).
    c.model = "decoder"
    c.attention = "linear"  # decoder self-attention; encoder too unless encoder_attention
    c.attention_options = ml_collections.ConfigDict()
    c.encoder_attention = ""  # encoder_decoder only; "" = attention
    c.encoder_attention_options = ml_collections.ConfigDict()
    c.cross_attention = ""  # encoder_decoder only; "" = the default for `attention`
    c.num_layers = 4
    c.num_heads = 8
    c.model_dim = 256
    c.feed_forward_dim = 1024
    c.dropout = 0.0
    c.attention_dropout = 0.0
    c.softmax_temp = 0.0  # 0 = 1/sqrt(head dim)
    c.dtype = "float32"  # computation: float32 | bfloat16 (parameters stay float32)

    # Optimisation.
    c.optimizer = "radam"
    c.learning_rate = 1e-3
    c.schedule = "step"
    c.decay_steps = 3000
    c.decay_factor = 0.1
    c.warmup_steps = 0
    c.weight_decay = 0.0
    c.grad_clip = 1.0
    c.batch_size = 64
    c.num_steps = 10_000

    # Bookkeeping (0 = never, except at the end of the run).
    c.log_every = 100
    c.eval_every = 1000
    c.eval_batches = 4  # held-out batches of batch_size for the accuracies
    c.checkpoint_every = 1000
    c.keep_checkpoints = 2
    c.progress_bar = True  # a line per log_every steps

    # Devices: a ("data", "sequence") mesh whose sizes multiply to the device count.
    # sequence > 1 splits time over that many devices (sequence parallelism; every attention
    # kind of the model must be linear, causal-linear or softmax; time is zero-padded to a
    # multiple, which changes no loss); data = batch split (data parallel, batch_size must
    # divide by it), -1 = the devices left over. E.g. --config.mesh.sequence=8.
    c.mesh = ml_collections.ConfigDict({"data": -1, "sequence": 1})
    return c
