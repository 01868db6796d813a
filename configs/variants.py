"""`configs/X.py:variant,key=value` strings shared by every experiment config."""

import ml_collections


def smoke(c: ml_collections.ConfigDict) -> None:
    """A tiny model and a handful of steps: for tests and a quick check of an install."""
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.model_dim = 16
    c.model.feed_forward_dim = 32
    c.num_mixtures = 2
    c.model.dropout = 0.0
    c.batch_size = 8
    c.num_steps = 6
    c.warmup_steps = 0
    c.log_every = 2
    c.eval_every = 3
    c.eval_batch_size = 16
    c.max_eval_examples = 20
    c.checkpoint_every = 3
    c.sample_every = 6
    c.num_samples = 4
    c.progress_bar = False


VARIANTS = {"smoke": smoke}


def apply(c: ml_collections.ConfigDict, arg: str, variants=None) -> ml_collections.ConfigDict:
    """Apply comma-separated variants, left to right: a name from `variants` (default the image
    VARIANTS), or `key=value` (value parsed like the field's type; `a.b=value` sets a nested
    field; a key that is not a top-level key but a field of config.model sets that field, so
    `attention=softmax` means `model.attention=softmax`), e.g.
    "smoke,attention=softmax,mesh.sequence=4"."""
    variants = VARIANTS if variants is None else variants
    for item in filter(None, (part.strip() for part in arg.split(","))):
        if "=" in item:
            key, value = item.split("=", 1)
            if key not in c and "." not in key and key in c.get("model", {}):
                key = f"model.{key}"
            # A dotted key ("mesh.sequence=8") sets a field of a nested ConfigDict.
            *path, leaf = key.split(".")
            node = c
            for name in path:
                if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
                    raise ValueError(f"config variant {item!r}: unknown key {key!r}; keys: {sorted(node)}.")
                node = node[name]
            if leaf not in node:
                raise ValueError(f"config variant {item!r}: unknown key {key!r}; keys: {sorted(node)}.")
            kind = node.get_type(leaf)
            if kind is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"config variant {item!r}: {key} needs true or false.")
                node[leaf] = value.lower() == "true"
            elif kind is ml_collections.ConfigDict:
                raise ValueError(
                    f"config variant {item!r}: {key} is a group of keys; "
                    f"set them one by one ({key}.name=value)."
                )
            else:
                try:
                    node[leaf] = kind(value)
                except ValueError:
                    raise ValueError(
                        f"config variant {item!r}: {key} needs {kind.__name__}, got {value!r}."
                    ) from None
        elif item in variants:
            variants[item](c)
        else:
            raise ValueError(f"unknown config variant {item!r}; variants: {sorted(variants)} or key=value.")
    return c
