"""The image-generation trainer's keys and defaults (`experiments.training.schemas`).

The experiment configs (`digits.py`, `mnist.py`, `cifar10.py`) start from `get_config()` here and
change what differs; the trainer rejects keys that are not in its schema, so a typo in a config
or an override fails loudly instead of being ignored.
"""

import ml_collections

from experiments.training import schemas


def get_config() -> ml_collections.ConfigDict:
    return schemas.image_generation()
