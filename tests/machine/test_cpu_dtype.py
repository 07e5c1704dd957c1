"""The CPU dtype decision: every branch of the pure function, the slow-dtype warnings, and
the facts read from this machine."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from backends.machine import cpu_dtype
from backends.machine.cpu_dtype import (
    CpuFacts,
    DtypeChoice,
    ProbeTiming,
    choose_dtype,
    decide_cpu_dtype,
    gather_cpu_facts,
    probe_bf16_matmul,
    read_cpuinfo,
)
from backends.native.loading.model_setup import EngineConfigError, resolve_dtype

BF16_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_FLAGS = frozenset({"avx2", "fma"})


def facts(flags: frozenset[str] | None = BF16_FLAGS, capability: str = "AVX512",
          onednn_bf16: bool | None = True, **env: str) -> CpuFacts:
    return CpuFacts("test cpu", flags, capability, onednn_bf16, env)


def no_probe() -> ProbeTiming:
    raise AssertionError("the facts were clear: the probe must not run")


class Probe:
    def __init__(self, bf16_s: float, fp32_s: float) -> None:
        self.timing = ProbeTiming(bf16_s, fp32_s)
        self.calls = 0

    def __call__(self) -> ProbeTiming:
        self.calls += 1
        return self.timing


def test_native_bf16_picks_bfloat16() -> None:
    choice = decide_cpu_dtype(facts(), no_probe)
    assert choice.dtype == torch.bfloat16
    assert "avx512_bf16" in choice.reason and choice.reason.startswith("auto:")


def test_amx_alone_counts_as_native() -> None:
    choice = decide_cpu_dtype(facts(flags=frozenset({"avx2", "amx_bf16"})), no_probe)
    assert choice.dtype == torch.bfloat16 and "amx_bf16" in choice.reason


def test_avx2_only_cpu_picks_float32() -> None:
    choice = decide_cpu_dtype(facts(flags=AVX2_FLAGS, capability="AVX2"), no_probe)
    assert choice.dtype == torch.float32 and "avx512_bf16" in choice.reason


def test_avx512_without_bf16_picks_float32() -> None:
    # oneDNN "supports" bf16 on plain AVX512_CORE, but emulated: 2-3x slower than fp32.
    choice = decide_cpu_dtype(facts(flags=frozenset({"avx512f", "avx512bw"})), no_probe)
    assert choice.dtype == torch.float32


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
@pytest.mark.parametrize("isa", ["AVX2", "avx512_core", "AVX512_CORE_VNNI"])
def test_onednn_isa_cap_picks_float32(variable: str, isa: str) -> None:
    choice = decide_cpu_dtype(facts(**{variable: isa}), no_probe)
    assert choice.dtype == torch.float32 and variable in choice.reason


@pytest.mark.parametrize("isa", ["AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL"])
def test_onednn_isa_at_or_above_bf16_keeps_bfloat16(isa: str) -> None:
    assert decide_cpu_dtype(facts(ONEDNN_MAX_CPU_ISA=isa), no_probe).dtype == torch.bfloat16


def test_onednn_variable_wins_over_the_older_dnnl_one() -> None:
    both = facts(ONEDNN_MAX_CPU_ISA="ALL", DNNL_MAX_CPU_ISA="AVX2")
    assert decide_cpu_dtype(both, no_probe).dtype == torch.bfloat16


def test_aten_capability_cap_picks_float32() -> None:
    # Even if torch were to report AVX512, the variable says: behave as an AVX2 machine.
    choice = decide_cpu_dtype(facts(ATEN_CPU_CAPABILITY="avx2"), no_probe)
    assert choice.dtype == torch.float32 and "ATEN_CPU_CAPABILITY=avx2" in choice.reason


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_torch_capability_below_avx512_picks_float32(capability: str) -> None:
    choice = decide_cpu_dtype(facts(capability=capability), no_probe)
    assert choice.dtype == torch.float32 and capability in choice.reason


def test_onednn_without_bf16_picks_float32() -> None:
    assert decide_cpu_dtype(facts(onednn_bf16=False), no_probe).dtype == torch.float32


@pytest.mark.parametrize("ambiguous", [
    facts(flags=None),  # no /proc/cpuinfo flags (another OS, a sandbox)
    facts(capability="SVE256"),  # a capability we do not know
    facts(onednn_bf16=None),  # torch built without oneDNN
    facts(ONEDNN_MAX_CPU_ISA="AVX11_FUTURE"),  # an ISA name we do not know
])
@pytest.mark.parametrize(("bf16_s", "fp32_s", "expected"), [
    (0.2e-3, 0.35e-3, torch.bfloat16),  # native: bf16 about twice as fast
    (14e-3, 0.35e-3, torch.float32),  # emulated: 40x slower
    (1e-3, 0.4e-3, torch.float32),  # AVX512_CORE-style emulation: 2.5x slower
])
def test_ambiguous_facts_are_settled_by_the_probe(
    ambiguous: CpuFacts, bf16_s: float, fp32_s: float, expected: torch.dtype
) -> None:
    probe = Probe(bf16_s, fp32_s)
    choice = decide_cpu_dtype(ambiguous, probe)
    assert probe.calls == 1
    assert choice.dtype == expected and "probe" in choice.reason


def test_clear_no_beats_an_ambiguity() -> None:
    # Unknown capability, but no bf16 flag: float32 without a probe.
    assert decide_cpu_dtype(facts(flags=AVX2_FLAGS, capability="?"), no_probe).dtype \
        == torch.float32


def test_read_cpuinfo(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 "
                    "avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert read_cpuinfo(str(path)) == ("Test CPU 9000", frozenset({"fpu", "avx2", "avx512_bf16"}))
    assert read_cpuinfo(str(tmp_path / "missing")) == (None, None)
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert read_cpuinfo(str(tmp_path / "arm")) == (None, None)


def test_gathered_facts_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    gathered = gather_cpu_facts()
    assert gathered.env == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert gathered.capability == torch.backends.cpu.get_cpu_capability()
    # Whatever this machine is, the cap alone decides: float32, no probe.
    assert decide_cpu_dtype(gathered, no_probe).dtype == torch.float32


def test_probe_times_both_dtypes_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    timing = probe_bf16_matmul(rows=8, size=64, repeats=2)
    assert torch.equal(torch.rand(3), expected)
    assert 0 < timing.bf16_s < 5 and 0 < timing.fp32_s < 5


@pytest.fixture
def auto_float32(monkeypatch: pytest.MonkeyPatch) -> DtypeChoice:
    """This machine's auto choice, pinned to 'bf16 is emulated here'."""
    choice = DtypeChoice(torch.float32, "auto: test: no native bf16")
    monkeypatch.setattr(cpu_dtype, "machine_cpu_choice", lambda: choice)
    return choice


def test_explicit_bf16_without_native_bf16_warns(
    auto_float32: DtypeChoice, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=cpu_dtype.__name__):
        choice = resolve_dtype("bfloat16", torch.device("cpu"))
    assert choice.dtype == torch.bfloat16  # explicit always wins
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bfloat16 is slow on this CPU" in warnings[0].getMessage()
    assert "no native bf16" in choice.reason


def test_explicit_fp16_on_cpu_always_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    native = DtypeChoice(torch.bfloat16, "auto: test: native")
    monkeypatch.setattr(cpu_dtype, "machine_cpu_choice", lambda: native)
    with caplog.at_level(logging.WARNING, logger=cpu_dtype.__name__):
        assert resolve_dtype("float16", torch.device("cpu")).dtype == torch.float16
    assert any("float16 matmul" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


@pytest.mark.parametrize(("name", "auto_dtype"), [("float32", torch.float32),
                                                  ("bfloat16", torch.bfloat16)])
def test_explicit_fast_dtype_does_not_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str,
    auto_dtype: torch.dtype,
) -> None:
    monkeypatch.setattr(cpu_dtype, "machine_cpu_choice",
                        lambda: DtypeChoice(auto_dtype, "auto: test"))
    with caplog.at_level(logging.WARNING, logger=cpu_dtype.__name__):
        assert resolve_dtype(name, torch.device("cpu")).name == name
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_uses_the_machine_choice_on_cpu_and_float16_on_cuda(
    auto_float32: DtypeChoice,
) -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == auto_float32
    cuda = choose_dtype(None, torch.device("cuda"))  # decides only; allocates nothing
    assert cuda.dtype == torch.float16 and "cuda" in cuda.reason


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(EngineConfigError, match="float8"):
        resolve_dtype("float8", torch.device("cpu"))
