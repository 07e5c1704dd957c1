"""Settings (env, flags, YAML) and the `switchyard` CLI; no torch behind the gateway."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.cli import build_parser, main, settings_from_args
from gateway.settings import ConfigError, Settings, parse_memory

REPO = Path(__file__).resolve().parents[2]


def _flags(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults() -> None:
    s = Settings()
    assert (s.model_id, s.hostname, s.port, s.backend) == ("default", "127.0.0.1", 8080, "native")
    assert s.engine_kwargs() == {"model": "default", "served_model_name": "default"}


def test_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_PORT", "9000")
    monkeypatch.setenv("SWITCHYARD_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("MAX_BATCH_SIZE", "99")  # unprefixed: not ours
    s = _flags("--port", "9100", "--model-id", "/models/x", "--served-model-name", "x")
    assert (s.port, s.max_batch_size, s.model_id, s.served_name()) == (9100, 8, "/models/x", "x")


def test_tgi_flag_names() -> None:
    s = _flags(
        "--max-input-length", "100", "--max-total-tokens", "200", "--max-batch-prefill-tokens",
        "300", "--max-batch-total-tokens", "4000", "--block-size", "32", "--dtype", "bfloat16",
        "--num-threads", "4", "--kv-cache-memory", "1.5GiB", "--max-batch-size", "16",
        "--hostname", "0.0.0.0",
    )
    assert s.engine_kwargs() == {
        "model": "default", "served_model_name": "default", "dtype": "bfloat16",
        "max_input_tokens": 100, "max_total_tokens": 200, "max_batch_size": 16,
        "max_batch_prefill_tokens": 300, "max_batch_total_tokens": 4000,
        "kv_cache_memory": 1.5 * 1024**3, "block_size": 32, "num_threads": 4,
    }
    assert _flags("--max-input-tokens", "7").max_input_tokens == 7


def test_max_input_length_env_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHYARD_MAX_INPUT_LENGTH", "11")
    assert Settings().max_input_tokens == 11
    monkeypatch.setenv("SWITCHYARD_MAX_INPUT_TOKENS", "12")
    assert Settings().max_input_tokens == 12


def test_memory_sizes() -> None:
    assert parse_memory("512M") == 512 * 1024**2
    assert parse_memory("0.9") == 0.9
    assert parse_memory(2) == 2.0
    with pytest.raises(ValueError):
        parse_memory("lots")


def test_invalid_values() -> None:
    with pytest.raises(ValidationError):
        Settings(dtype="float8")
    with pytest.raises(ValidationError):
        Settings(max_batch_size=0)
    with pytest.raises(ValidationError):
        Settings(unknown_knob=1)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--dtype", "float8"])
    assert info.value.code == 2


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n"
        "  - name: small\n    model_id: /m/small\n    aliases: [s, tiny]\n"
        "    options: {max_batch_size: 4}\n"
        "  - name: big\n    model_id: /m/big\n    backend: native\n"
    )
    specs = Settings(config_file=path, block_size=32, max_batch_size=64).model_specs()
    assert [(s.name, s.model_id, s.backend, s.aliases) for s in specs] == [
        ("small", "/m/small", "native", ("s", "tiny")), ("big", "/m/big", "native", ())]
    assert specs[0].options == {"block_size": 32, "max_batch_size": 4}
    assert specs[1].options == {"block_size": 32, "max_batch_size": 64}


def test_bad_config_file(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - name: x\n")
    with pytest.raises(ConfigError, match=r"models\[0\]: `model_id` or `deployments` is required"):
        Settings(config_file=path).model_specs()


def test_nothing_behind_the_gateway_imports_torch() -> None:
    code = (
        "import sys, gateway.app, gateway.cli, gateway.settings, auth, routing, backends.registry;"
        "from gateway.app import create_app; from gateway.settings import Settings;"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for flag in ("--model-id", "--max-input-tokens", "--max-input-length", "--kv-cache-memory",
                 "--max-batch-prefill-tokens", "--served-model-name", "--num-threads"):
        assert flag in out


class _AppCreated(Exception):
    pass


@pytest.fixture
def kernels_at_app_creation(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """`switchyard serve` up to the app's creation (no model loads): what
    SWITCHYARD_CPU_KERNELS holds in the process environment by then."""
    seen: list[str | None] = []

    def create_app(*args: object, **kwargs: object) -> None:
        seen.append(os.environ.get("SWITCHYARD_CPU_KERNELS"))
        raise _AppCreated

    monkeypatch.setattr("gateway.app.create_app", create_app)
    monkeypatch.setattr("gateway.cli.configure_logging", lambda *args: None)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setenv("SWITCHYARD_CPU_KERNELS", "")
    monkeypatch.delenv("SWITCHYARD_CPU_KERNELS")  # restored as it was after the test
    return seen


@pytest.mark.parametrize(("argv", "env", "exported"), [
    (["--cpu-kernels", "required"], None, "required"),
    (["--cpu-kernels", "off"], "avx2", "off"),  # the flag wins
    ([], "AVX2", "avx2"),
    ([], None, None),  # nothing given: the builder's own default
])
def test_cpu_kernels_reach_the_environment_before_the_app_exists(
        kernels_at_app_creation: list[str | None], monkeypatch: pytest.MonkeyPatch,
        argv: list[str], env: str | None, exported: str | None) -> None:
    if env is not None:
        monkeypatch.setenv("SWITCHYARD_CPU_KERNELS", env)
    with pytest.raises(_AppCreated):
        main(["serve", *argv])
    assert kernels_at_app_creation == [exported]


@pytest.mark.parametrize(("argv", "env"), [(["--cpu-kernels", "fast"], None), ([], "fast")])
def test_a_bad_cpu_kernels_value_exits_2_naming_it(
        kernels_at_app_creation: list[str | None], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], argv: list[str], env: str | None) -> None:
    if env is not None:
        monkeypatch.setenv("SWITCHYARD_CPU_KERNELS", env)
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-kernels / SWITCHYARD_CPU_KERNELS" in err and "'fast'" in err
    assert "'required'" in err
    assert kernels_at_app_creation == []


THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="this kernel gives no transparent huge pages")
@pytest.mark.parametrize(("given", "huge"), [(None, True), ("0", False)])
def test_serving_backs_torch_allocations_with_huge_pages(given: str | None, huge: bool) -> None:
    """What `serve` sets before any backend loads reaches torch's allocator: a 32 MB tensor
    lands in transparent huge pages, unless THP_MEM_ALLOC_ENABLE=0 was given."""
    code = (
        "from gateway.cli import prefer_huge_pages; prefer_huge_pages();"
        "import torch; x = torch.ones(8 << 20);"
        "rollup = open('/proc/self/smaps_rollup').read();"
        "print(int(rollup.split('AnonHugePages:')[1].split()[0]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert (int(out.split()[-1]) >= 16 << 10) == huge  # kB
