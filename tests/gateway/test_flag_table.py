"""gateway/flag_table.py against what it describes: every Settings field has one flag, a
variable, help and a default; each default is the one that applies (EngineConfig's for engine
knobs); `serve --help` and README's flag tables show the same."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import pytest

from backends.cpu_kernels.status import SETTING, SETTINGS, normalize
from backends.machine.cache_dir import DEFAULT_CACHE_DIR
from backends.native.config import EngineConfig, default_prefill_tokens
from backends.quantized.config import KERNEL_CHOICES, QUANTIZE_CHOICES
from gateway.cli import build_parser, main
from gateway.flag_parser import choices_of, default_text, env_var, value_type
from gateway.flag_table import ALIASES, GROUPS, Flag, Note, all_flags
from gateway.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# served models start with the registry's cache directory (backends/registry.py)
SERVED_DEFAULTS = {**ENGINE_DEFAULTS, "cache_dir": DEFAULT_CACHE_DIR}
FLAGS = all_flags()


def _ids(flag: Flag) -> str:
    return flag.setting


def _other_value(flag: Flag) -> str:
    """A valid value for the flag's field that is not its default."""
    if flag.switch:
        return str(flag.sets).lower()
    choices = choices_of(flag.setting)
    if choices:
        return next(choice for choice in choices if choice != flag.default)
    if value_type(flag.setting) is bool:
        return "false" if flag.default == "true" else "true"
    if flag.metavar == "JSON":
        return '{"temperature": 0.5}'
    if flag.metavar == "ORIGINS":
        return "https://app.example.com"
    return "7"


def test_every_setting_has_one_flag() -> None:
    settings = [flag.setting for flag in FLAGS]
    assert len(settings) == len(set(settings))
    assert set(settings) == set(Settings.model_fields) - ALIASES
    names = [name for flag in FLAGS for name in flag.names]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("flag", FLAGS, ids=_ids)
def test_each_flag_has_help_a_default_and_a_variable_that_reaches_its_field(
        flag: Flag, monkeypatch: pytest.MonkeyPatch) -> None:
    assert flag.help.strip() and default_text(flag).strip()
    assert env_var(flag.setting) == "SWITCHYARD_" + flag.setting.upper()
    for name in [n for n in os.environ if n.startswith("SWITCHYARD_")]:
        monkeypatch.delenv(name)
    unset = getattr(Settings(), flag.setting)
    value = _other_value(flag)
    monkeypatch.setenv(env_var(flag.setting), value)
    from_env = getattr(Settings(), flag.setting)
    assert from_env == getattr(Settings(**{flag.setting: value}), flag.setting) != unset


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.setting in ENGINE_DEFAULTS], ids=_ids)
def test_an_engine_knob_shows_the_engine_default(flag: Flag) -> None:
    engine_default = SERVED_DEFAULTS[flag.setting]
    if isinstance(flag.default, Note):
        assert engine_default is None, f"{flag.setting}: show {engine_default!r}"
        return
    assert getattr(Settings(**{flag.setting: flag.default}), flag.setting) == engine_default


def test_the_prefill_default_names_both_cases() -> None:
    (flag,) = [f for f in FLAGS if f.setting == "max_batch_prefill_tokens"]
    numbers = re.findall(r"\d+", default_text(flag))
    assert numbers == [str(default_prefill_tokens("cpu", True)),
                       str(default_prefill_tokens("cuda", False))]


def test_quantization_choices_are_the_engines() -> None:
    assert choices_of("quantize") == QUANTIZE_CHOICES
    assert choices_of("quantized_kernels") == KERNEL_CHOICES


def test_cpu_kernels_takes_what_the_kernel_builder_reads() -> None:
    (flag,) = [f for f in FLAGS if f.setting == "cpu_kernels"]
    assert env_var(flag.setting) == SETTING
    assert set(choices_of(flag.setting) or ()) == set(SETTINGS)
    assert flag.default == normalize("")


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.setting not in ENGINE_DEFAULTS],
                         ids=_ids)
def test_a_gateway_setting_shows_its_settings_default(flag: Flag) -> None:
    field_default = Settings.model_fields[flag.setting].default
    if field_default is None:  # unset: the reader's own default, a valid value, or a note
        if isinstance(flag.default, str):
            Settings(**{flag.setting: flag.default})
        return
    assert isinstance(flag.default, str), flag.setting
    assert getattr(Settings(**{flag.setting: flag.default}), flag.setting) == field_default


def test_every_spelling_reaches_its_field() -> None:
    serve = _serve_parser()
    dests = {name: action.dest for action in serve._actions for name in action.option_strings}
    for flag in FLAGS:
        for name in flag.names:
            assert dests[name] == flag.setting
    for old in ("--max-input-length", "--payload-limit", "--no-chunked-prefill",
                "--no-playground", "--auth-fail-open"):
        assert old in dests


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    return commands.choices["serve"]


def _help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_groups_the_flags_and_marks_variable_and_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = _help(capsys, monkeypatch, 100)
    titles = [line[:-1] for line in out.splitlines() if line.endswith(":") and
              not line.startswith(" ")]
    assert titles == ["options", *(group.title for group in GROUPS)]
    for marker in ("[env: SWITCHYARD_MAX_BATCH_SIZE=] [default: 64]",
                   "[env: SWITCHYARD_CPU_KERNELS=] [default: auto]",
                   "[env: SWITCHYARD_KV_CACHE_MEMORY=] [default: 2GiB]",
                   "[default: 512 on CPU with chunked prefill, else 4096]",
                   "[env: SWITCHYARD_PLAYGROUND=false] [default: true]",
                   "--max-input-tokens N, --max-input-length N",
                   "--cpu-kernels auto|required|avx512-vnni|avx2|off"):
        assert marker in out
    for flag in FLAGS:
        assert f"[env: {env_var(flag.setting)}=" in out


def test_narrow_help_never_breaks_a_marker(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = _help(capsys, monkeypatch, 60)
    for line in out.splitlines():
        assert line.count("[") == line.count("]"), line
    assert out.count("[env: SWITCHYARD_") == len(FLAGS)


def _readme_rows() -> dict[str, list[str]]:
    """The flag rows of README's `switchyard serve` section, by the row's first flag."""
    section = README.read_text().split("\n## `switchyard serve`\n")[1].split("\n## ")[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip().strip("`") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            flag = re.match(r"--[a-z0-9-]+", cells[0])
            assert flag, line
            rows[flag.group()] = cells
    return rows


def test_readme_lists_every_flag_with_its_variable_and_default() -> None:
    rows = _readme_rows()
    assert set(rows) == {flag.names[0] for flag in FLAGS}
    for flag in FLAGS:
        _, variable, default, meaning = rows[flag.names[0]]
        value = f"={str(flag.sets).lower()}" if flag.switch else ""
        assert variable == env_var(flag.setting) + value
        assert default == default_text(flag), flag.names[0]
        assert meaning
