"""`switchyard serve`'s flags, built from the table in flag_table.py: argument groups whose
help shows each flag's variable and default, TGI-style (`[env: SWITCHYARD_PORT=]
[default: 8080]`), and setting errors named by flag and variable."""

from __future__ import annotations

import argparse
import re
import textwrap
import types
import typing
from typing import Annotated, Literal

from pydantic import ValidationError

from gateway.flag_table import GROUPS, Flag, Note, all_flags
from gateway.settings import Settings

DESCRIPTION = ("Serve models over an OpenAI-compatible API. Every flag can also be given as "
               "the environment variable its [env: ...] names; a flag wins over its variable.")
_MARKER = re.compile(r"\[[^\]]*\]")


def env_var(setting: str) -> str:
    """The environment variable Settings reads for a field."""
    return f"{Settings.model_config.get('env_prefix', '')}{setting}".upper()


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    for group in GROUPS:
        section = serve.add_argument_group(group.title)
        for flag in group.flags:
            _add_flag(section, flag)


def _add_flag(section: argparse._ArgumentGroup, flag: Flag) -> None:
    help_text = f"{flag.help}\n{markers(flag)}".replace("%", "%%")
    if flag.switch:
        section.add_argument(*flag.names, dest=flag.setting, action="store_const",
                             const=flag.sets, default=argparse.SUPPRESS, help=help_text)
        return
    choices = choices_of(flag.setting) if flag.parser_checks else None
    section.add_argument(*flag.names, dest=flag.setting, default=argparse.SUPPRESS,
                         choices=choices, metavar=metavar(flag), help=help_text)


def markers(flag: Flag) -> str:
    value = str(flag.sets).lower() if flag.switch else ""
    return f"[env: {env_var(flag.setting)}={value}] [default: {default_text(flag)}]"


def default_text(flag: Flag) -> str:
    return flag.default.text if isinstance(flag.default, Note) else flag.default


def metavar(flag: Flag) -> str:
    choices = choices_of(flag.setting)
    if flag.metavar or choices:
        return flag.metavar or "|".join(choices or ())
    base = value_type(flag.setting)
    return {bool: "true|false", int: "N", float: "NUMBER"}.get(base, "TEXT")


def choices_of(setting: str) -> tuple[str, ...] | None:
    """The values a Literal field takes, else None."""
    annotation = _unwrap(Settings.model_fields[setting].annotation)
    if typing.get_origin(annotation) is Literal:
        return tuple(str(value) for value in typing.get_args(annotation))
    return None


def value_type(setting: str) -> object:
    """A field's type, without `| None` and constraints: int, float, bool, str, Path, ..."""
    return _unwrap(Settings.model_fields[setting].annotation)


def _unwrap(annotation: object) -> object:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(annotation)
    if origin is Annotated:
        return typing.get_args(annotation)[0]
    return annotation


class HelpFormatter(argparse.HelpFormatter):
    """Each help line wrapped on its own; a `[env: ...] [default: ...]` line is wrapped
    between its markers, never inside one."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        for paragraph in text.splitlines():
            if paragraph.startswith("[env: "):
                lines += _pack(_MARKER.findall(paragraph), width)
            else:
                lines += textwrap.wrap(paragraph, width, break_on_hyphens=False) or [""]
        return lines


def _pack(units: list[str], width: int) -> list[str]:
    lines: list[str] = []
    for unit in units:
        if lines and len(lines[-1]) + 1 + len(unit) <= width:
            lines[-1] += " " + unit
        else:
            lines.append(unit)
    return lines


def describe_errors(exc: ValidationError) -> str:
    """One line per invalid setting, naming its flag and variable and the value given."""
    flags = {flag.setting: flag for flag in all_flags()}
    lines = []
    for error in exc.errors():
        setting = str(error["loc"][0]) if error["loc"] else ""
        where = env_var(setting) if setting in Settings.model_fields else setting or "settings"
        if setting in flags:
            where = f"{flags[setting].names[0]} / {where}"
        lines.append(f"  {where}: {error['msg']} (given: {error.get('input')!r})")
    return "\n".join(lines)
