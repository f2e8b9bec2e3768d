"""The command-line flags that fill :class:`~normexport.arguments.options.Options`, made from
its fields (each declares its flag: :class:`~normexport.arguments.options.Flag`), in the groups
the subcommands share (see :mod:`normexport.arguments`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from normexport.arguments.options import FLAG_GROUPS, Options, make_options


def options_from_args(args: argparse.Namespace) -> Options:
    """The :class:`Options` that parsed flags ask for: every field a flag of this parser
    fills (its ``dest`` is the field's name); the others keep their defaults."""
    given = vars(args)
    names = [f.name for f in dataclasses.fields(Options)]
    return make_options(**{name: given[name] for name in names if name in given})


def add_flags(p: argparse.ArgumentParser, group: str, **defaults: Any) -> None:
    """The flags of the :class:`Options` fields of ``group`` (one of
    :data:`~normexport.arguments.options.FLAG_GROUPS`), in field order, each as its field's
    :class:`~normexport.arguments.options.Flag` says: ``dest`` the field's name, ``default``
    the field's (or ``defaults``' of that name: a command's own, as bench's ``budget_s``).

    Raises:
        ValueError: ``group`` is no group, or ``defaults`` names no field of it.
    """
    if group not in FLAG_GROUPS:
        raise ValueError(f"no group of flags {group!r}: choose one of {FLAG_GROUPS}")
    fields = [f for f in dataclasses.fields(Options) if f.metadata.get("flag", None)]
    fields = [f for f in fields if f.metadata["flag"].group == group]
    if unknown := set(defaults) - {f.name for f in fields}:
        raise ValueError(f"the group {group!r} has no flag {sorted(unknown)}")
    for field in fields:
        flag = field.metadata["flag"]
        keywords = dict(flag.argparse)
        name = field.name.replace("_", "-")
        if isinstance(field.default, bool):
            keywords["action"] = "store_false" if field.default else "store_true"
            name = f"no-{name}" if field.default else name
        names = flag.names or (f"--{name}",)
        if names[0].startswith("-"):  # a positional's dest is its name
            keywords["dest"] = field.name
            default = field.default if field.default is not dataclasses.MISSING else None
            if keywords.get("action") == "append":  # None: the field's default (make_options)
                default = None
            keywords["default"] = defaults.get(field.name, default)
        p.add_argument(*names, help=flag.help, **keywords)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and the flags that say how to load and export it, and ``--debug`` (main command,
    explain, bench)."""
    add_flags(p, "model")
    p.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks, and the libraries' warnings and log lines (hidden otherwise)",
    )
