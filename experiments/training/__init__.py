"""The image-generation trainer, in small pieces: optimizer, checkpoints, metrics, images, loop.

`experiments.train` is the command line; `loop.train_and_evaluate(config, workdir)` does the work.
"""
