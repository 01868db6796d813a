"""The --config flag of the training commands: a config file with `:variants`, and
`--config.key=value` overrides, whose mistakes end in one line.

- A free-form group of keys (`attention_options`, whose names are the attention kind's) takes
  new names from the command line: `--config.model.attention_options.feature_map=favor`, or the
  whole group as a JSON object (or Python dict),
  `--config.model.attention_options='{"feature_map": "favor"}'`. Any key a config does not have
  is accepted while parsing and refused by name, with the keys that exist, by the trainer's
  checks (config_checks.check_keys, the attention kind's option check) before any work.
- `parse_flags` (absl's `flags_parser`) turns a mistake found while parsing (an unknown
  variant, an unknown group in an override's path, a value that does not parse) into
  `<program>: error: <what>` and exit status 1, as `cli.one_line_errors` does for `main`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as config_flags_lib

from experiments.cli import missing_config_file

_FLAG = "config"
_default_config = ""


class _GroupParser(config_flags_lib._ConfigDictParser):
    """A group of keys given whole: a JSON object, or a Python dict literal (ml_collections'
    own form, e.g. with True/None)."""

    def parse(self, argument):
        if isinstance(argument, str):
            try:
                value = json.loads(argument)
            except ValueError:
                value = None
            if isinstance(value, dict):
                return ml_collections.ConfigDict(value)
            try:
                value = ast.literal_eval(argument)
            except (SyntaxError, ValueError):
                value = None
            if not isinstance(value, dict):
                raise ValueError(
                    f"{argument!r} is not a group of keys: give a JSON object, e.g. "
                    f'\'{{"feature_map": "favor"}}\', or set one key with .name=value.'
                )
            return ml_collections.ConfigDict(value)
        return super().parse(argument)


def define_config_flag(default: str, flag_values: flags.FlagValues = flags.FLAGS, sys_argv=None) -> None:
    """--config: a config file (`path:variants`, default `default`) with `--config.key=value`
    overrides, as described in the module docstring (`flag_values`, `sys_argv`: as in
    ml_collections' DEFINE_config_file)."""
    global _default_config
    _default_config = default
    config_flags.register_flag_parser_for_type(ml_collections.ConfigDict, _GroupParser())
    # accept_new_attributes needs an unlocked config; the trainer refuses unknown keys itself.
    config_flags.DEFINE_config_file(
        _FLAG,
        default,
        "Experiment config.",
        flag_values=flag_values,
        lock_config=False,
        accept_new_attributes=True,
        sys_argv=sys_argv,
    )


def _innermost(error: BaseException) -> BaseException:
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def _config_argument(argv) -> str:
    """The --config value in `argv` (the last one), else the default."""
    value = _default_config
    for i, arg in enumerate(argv):
        if arg in (f"--{_FLAG}", f"-{_FLAG}") and i + 1 < len(argv):
            value = argv[i + 1]
        elif re.match(rf"^--?{_FLAG}=", arg):
            value = arg.split("=", 1)[1]
    return value


def _unknown_group(argv) -> str | None:
    """'--config.a.b.c: ...' for the first override whose path goes through a key the config
    lacks (or one that is not a group), listing the keys there; None if every path is sound."""
    try:
        config = config_flags_lib.ConfigFileFlagParser(_FLAG, lock_config=False).parse(_config_argument(argv))
    except Exception:  # noqa: BLE001 - the original error is reported instead
        return None
    for arg in argv:
        match = re.match(rf"^--?(?:no)?{_FLAG}\.([^=]+)", arg)
        if not match:
            continue
        *path, _ = match.group(1).split(".")
        node, where = config, _FLAG
        for name in path:
            if name not in node:
                return (
                    f"--{_FLAG}.{match.group(1)}: {where} has no key {name!r}; its keys are {sorted(node)}."
                )
            node, where = node[name], f"{where}.{name}"
            if node is None:  # an unset group (a placeholder): it can only be given whole
                return (
                    f"--{_FLAG}.{match.group(1)}: {where} is unset; give it whole, as JSON: "
                    f"--{where}='{{...}}'."
                )
            if not isinstance(node, ml_collections.ConfigDict):
                return f"--{_FLAG}.{match.group(1)}: {where} is {node!r}, not a group of keys."
    return None


def flag_error_message(error: BaseException, argv) -> str:
    """One line saying what is wrong with the command line `argv`, from a parsing `error`."""
    text = str(error)
    missing = missing_config_file(_config_argument(argv).split(":", 1)[0], _FLAG)
    if missing:
        text = missing
    elif "Error whilst parsing config file" in text:
        # get_config raised (an unknown variant, a bad key=value): its own message says it.
        inner = _innermost(error)
        text = f"--{_FLAG}={_config_argument(argv)}: {inner}"
    elif isinstance(error, (KeyError, AttributeError, TypeError)) or "can not be applied" in text:
        text = _unknown_group(argv) or text
    return " ".join(text.split()) or type(error).__name__


def parse_flags(argv):
    """absl's flags_parser: parse `argv`, or print one line and exit with status 1."""
    try:
        return flags.FLAGS(argv)
    # ml_collections raises these for an override whose path the config does not have.
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError) as e:
        program = os.path.basename(argv[0]).removesuffix(".py") or "experiments"
        print(f"{program}: error: {flag_error_message(e, argv)}", file=sys.stderr, flush=True)
        sys.exit(1)
