"""Command-line flags generated from an options dataclass, and the benchmarks' absl `main`.

`define(Options)` defines one absl flag per field: the field's name, default and type (int,
float, str, bool, `Literal[...]` as an enum, `tuple[T, ...]` as a comma-separated list of T, any
of them `| None`), and its help from a docstring line `name: help` of the class or a base class
(continued on more deeply indented lines) or the field's `metadata["help"]`. A tuple's elements
are converted by `metadata["parse"]` when the field has one, else by T itself. It returns
`build()`, which makes the dataclass from the parsed flags; a value that the conversion or the
dataclass (its `__post_init__`) refuses comes back as a ValueError that names the flag:
`--kinds=flash: unknown attention kind 'flash'; ...`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing

from absl import flags as absl_flags

_SCALARS = {
    int: absl_flags.DEFINE_integer,
    float: absl_flags.DEFINE_float,
    str: absl_flags.DEFINE_string,
    bool: absl_flags.DEFINE_bool,
}


def field_help(cls) -> dict[str, str]:
    """{field: help} from the docstring lines `name: text` of `cls` and its bases."""
    names, found = {f.name for f in dataclasses.fields(cls)}, {}
    for doc in [klass.__doc__ or "" for klass in reversed(cls.__mro__)]:
        name, indent = None, 0
        for line in doc.splitlines():
            depth = len(line) - len(line.lstrip())
            match = re.match(r"\s*(\w+): (.*)", line)
            if match and match[1] in names:
                name, indent, found[match[1]] = match[1], depth, match[2].strip()
            elif name and line.strip() and depth > indent:
                found[name] += " " + line.strip()
            else:
                name = None
    return found


def _flag_type(hint):
    """`hint` without `| None`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    return hint


def define(cls, flag_values=absl_flags.FLAGS, module_name: str | None = None):
    """Define a flag per field of the dataclass `cls`, as flags of `module_name` (default: the
    caller's; --help lists the main module's); returns `build()` -> `cls` (see above)."""
    helps, hints = field_help(cls), typing.get_type_hints(cls)
    where = {"flag_values": flag_values, "module_name": module_name or _caller()}
    parsers = {}
    for field in dataclasses.fields(cls):
        hint, name = _flag_type(hints[field.name]), field.name
        help_text = field.metadata.get("help") or helps.get(name)
        if not help_text:
            raise TypeError(f"{cls.__name__}.{name} has no help: document it in the docstring.")
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        if typing.get_origin(hint) is tuple:
            parsers[name] = field.metadata.get("parse", typing.get_args(hint)[0])
            default = None if default is None else [str(v) for v in default]
            absl_flags.DEFINE_list(name, default, help_text, **where)
        elif typing.get_origin(hint) is typing.Literal:
            absl_flags.DEFINE_enum(name, default, [str(c) for c in typing.get_args(hint)], help_text, **where)
        elif hint in _SCALARS:
            _SCALARS[hint](name, default, help_text, **where)
        else:
            raise TypeError(f"{cls.__name__}.{name}: no flag for the type {hint!r}.")

    def build():
        values = {f.name: flag_values[f.name].value for f in dataclasses.fields(cls)}
        for name, parse in parsers.items():
            if values[name] is not None:
                values[name] = tuple(_convert(parse, text, flag_values[name]) for text in values[name])
        try:
            return cls(**values)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"{_blame(cls, values, flag_values)}: {e}") from e

    return build


def _caller() -> str:
    """The module that called our caller, named as absl names modules (__main__: its path)."""
    name = sys._getframe(2).f_globals["__name__"]
    return sys.argv[0] if name == "__main__" else name


def _convert(parse, text: str, flag):
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{flag.serialize()}: {e}") from e


def _blame(cls, values: dict, flag_values) -> str:
    """The flags a refused set of values is due to: each given flag that alone (the others at
    their defaults) is refused too, else every given flag."""
    given = [name for name in values if flag_values[name].present]

    def refused(name):
        try:
            cls(**{name: values[name]})
        except Exception:  # noqa: BLE001 - any refusal blames the flag
            return True
        return False

    return " ".join(flag_values[name].serialize() for name in [n for n in given if refused(n)] or given)


def main(cls, run, *, out_dir: str, device: bool = True, announce: bool = True):
    """Define `cls`'s flags, --out_dir (default `out_dir`) and, with `device`, --device; returns
    the absl main that builds the options, prints the JAX backend (`announce`) and calls
    `run(options, out_dir)`. A user's mistake ends in one line (`cli.one_line_errors`)."""
    from experiments import cli

    where = {"module_name": _caller()}
    build = define(cls, **where)
    out = absl_flags.DEFINE_string(
        "out_dir", out_dir, "Where the results (tables, plots, reports) go.", **where
    )
    if device:
        choices = ["cpu", "gpu", "tpu"]
        platform = absl_flags.DEFINE_enum("device", None, choices, "Backend (default: JAX's).", **where)

    @cli.one_line_errors
    def absl_main(argv):
        del argv  # `one_line_errors` refused any positional argument.
        if device and platform.value:
            import jax

            jax.config.update("jax_platforms", platform.value)
        opts = build()
        if announce:
            from experiments.training import mesh

            mesh.announce_backend()
        run(opts, out.value)

    return absl_main
