"""The image-generation task's keys and defaults (`experiments.tasks.image_generation.schema`).

The experiment configs (`digits.py`, `mnist.py`, `cifar10.py`) start from `get_config()` here and
change what differs; the trainer rejects keys that are not in the schema, so a typo in a config
or an override fails loudly instead of being ignored.
"""

import ml_collections

from experiments.tasks import image_generation


def get_config() -> ml_collections.ConfigDict:
    return image_generation.schema()
