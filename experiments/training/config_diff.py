"""What differs between two configs, and how a difference is written: "key: old -> new".

Three places compare a config with another: a checkpoint written under another config
(checkpoints.py), processes of one run that must all run process 0's config (processes.py), and
a resumed run whose model must be the one its checkpoint was trained as (model_change.py). Each
chooses which keys count; all name what differs the same way. Configs are compared as JSON dicts
(`ConfigDict.to_json_best_effort`, a workdir's config.json), and their values are written as
JSON (a string as it is).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

# The new value of a key that the new config does not have.
ABSENT = "(absent)"


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key of `old`, in its order, whose value in `new`
    differs (ABSENT where `new` lacks the key). A key only `new` has is not listed: the old
    config cannot say what it was."""
    return [(key, value, new.get(key, ABSENT)) for key, value in old.items() if new.get(key, ABSENT) != value]


def format_difference(key: str, old: Any, new: Any) -> str:
    """'key: old -> new', each value a string as it is, anything else as JSON."""
    return f"{key}: {_text(old)} -> {_text(new)}"


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """'key: old -> new' for every dotted key (`model.model_dim`) of a nested config `old` whose
    value differs in `new`, in the keys' order."""
    flat_old, flat_new = _flatten(old), _flatten(new)
    return [format_difference(*d) for d in differences(dict(sorted(flat_old.items())), flat_new)]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of the leaves (values that are not dicts) of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
