"""`name,key=value` strings applied to a config: what follows the colon in
`--config configs/X.py:...`, and a benchmark's overrides. The syntax is every experiment's; the
named variants are each experiment's own (a task's, e.g. `experiments.tasks.copy.VARIANTS`, or
a family of configs', e.g. `configs/image_base.py`'s)."""

import ast
from collections.abc import Callable, Mapping

import ml_collections


def apply(
    c: ml_collections.ConfigDict,
    arg: str,
    variants: Mapping[str, Callable[[ml_collections.ConfigDict], None]],
) -> ml_collections.ConfigDict:
    """Apply comma-separated variants, left to right: a name from `variants`, or `key=value`
    (value parsed like the field's type; `a.b=value` sets a nested field; a key that is not a
    top-level key but a field of config.model sets that field, so `attention=softmax` means
    `model.attention=softmax`; an attention kind's options take any name,
    `attention_options.feature_map=favor`), e.g. "smoke,attention=softmax,mesh.sequence=4".

    A variant that derives a value from others names them in its `reads` attribute (dotted
    keys); an item after it that changes one of them is refused, naming both: the derived value
    would silently keep the old one."""
    read = []  # (variant, {key: its value when the variant read it})
    for item in filter(None, (part.strip() for part in arg.split(","))):
        _apply_one(c, item, variants)
        for name, values in read:
            for key, value in values.items():
                if _get(c, key) != value:
                    raise ValueError(
                        f"config variant {item!r} changes {key} ({value!r} -> {_get(c, key)!r}), which "
                        f"{name!r} before it read; put {name!r} after {item!r}."
                    )
        reads = getattr(variants.get(item), "reads", ())
        if reads:
            read.append((item, {key: _get(c, key) for key in reads}))
    return c


def _get(c: ml_collections.ConfigDict, dotted: str):
    for name in dotted.split("."):
        c = c[name]
    return c


def _apply_one(c, item: str, variants) -> None:
    """One item of `apply`: `key=value` or a variant's name."""
    if "=" in item:
        key, value = item.split("=", 1)
        first = key.split(".")[0]
        if first not in c and first in c.get("model", {}):
            key = f"model.{key}"
        # A dotted key ("mesh.sequence=8") sets a field of a nested ConfigDict.
        *path, leaf = key.split(".")
        node = c
        for name in path:
            if name not in node or not isinstance(node[name], ml_collections.ConfigDict):
                raise ValueError(f"config variant {item!r}: unknown key {key!r}; keys: {sorted(node)}.")
            node = node[name]
        if leaf not in node and path and path[-1].endswith("_options"):
            # An attention kind's options: any name (the kind's check refuses those it
            # does not take, by name), the value read as a Python literal or a string.
            node[leaf] = _literal(value)
            return
        if leaf not in node:
            raise ValueError(f"config variant {item!r}: unknown key {key!r}; keys: {sorted(node)}.")
        kind = node.get_type(leaf)
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"config variant {item!r}: {key} needs true or false.")
            node[leaf] = value.lower() == "true"
        elif kind is ml_collections.ConfigDict:
            raise ValueError(
                f"config variant {item!r}: {key} is a group of keys; set them one by one ({key}.name=value)."
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


def _literal(value: str):
    """`value` as a Python literal (64, 0.5, True/true, None), else the string itself."""
    if value in ("true", "false"):
        return value == "true"
    try:
        return ast.literal_eval(value)
    except (SyntaxError, ValueError):
        return value
