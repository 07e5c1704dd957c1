"""Grammar engines for structured outputs: xgrammar vs llguidance, measured on this machine.

For each engine and tokenizer (the default model's, vocab 49152, and a tiny trained BPE):
tokenizer-info build time; compile time of (a) any JSON object, (b) a nested JSON schema with
enums, arrays and required fields, (c) a regex; and the per-token mask fill over a real token
walk (a valid document tokenized, fed one token at a time, the mask filled and timed before
each token) for one matcher and for 16 matchers filled per step through the engine's batch
API. Every walked token is checked against the filled mask, so a wrong mask fails the bench.
JSON is compiled with fixed separators and no free whitespace (as the native backend does).
Also: each engine's installed footprint with the packages it pulls in.

    .venv/bin/python -m bench.grammar_engines [--repeats 3] [--json out.json]

xgrammar is not a dependency (llguidance won, see docs/architecture.md); to compare, install it
first: `.venv/bin/pip install -c <(echo torch==2.13.0) xgrammar`. A missing engine is skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

from bench.common import configure_threads, facts_line, machine_facts, write_json

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                        "maxItems": 2},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"year": {"type": "integer"}, "event": {"type": "string"}},
                "required": ["year", "event"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT: dict[str, Any] = {
    "name": "Ada Lovelace", "age": 36, "role": "editor", "active": True,
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "12345", "geo": [51.5072, -0.1276]},
    "history": [{"year": 1833, "event": "met Babbage"}, {"year": 1843, "event": "published notes"}],
}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2} [A-Z][a-z]+( [A-Z][a-z]+)*"
REGEX_TEXT = "2024-05-17T09:30 Grace Brewster Murray Hopper Was Here"
BATCH = 16
TINY_CORPUS = [json.dumps(DOCUMENT), json.dumps(SCHEMA), REGEX_TEXT,
               "The quick brown fox jumps over the lazy dog. 0123456789 {}[],:\""]


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _best(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    runs = [_timed(fn) for _ in range(repeats)]
    return min(t for t, _ in runs), runs[-1][1]


def _stats_us(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"mean_us": 1e6 * statistics.fmean(ordered),
            "p50_us": 1e6 * ordered[len(ordered) // 2],
            "p99_us": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_us": 1e6 * ordered[-1]}


def _allowed(bitmask: Any, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


# ---- the engines, behind one small shape: info(), compile(kind, spec), walk(...) ----------


class XGrammar:
    name = "xgrammar"
    packages = ("xgrammar", "triton", "apache-tvm-ffi")

    def __init__(self, hf: Any, vocab_size: int, eos: list[int]) -> None:
        self.hf, self.vocab_size, self.eos = hf, vocab_size, eos

    def info(self) -> None:
        import xgrammar as xgr

        self.tok = xgr.TokenizerInfo.from_huggingface(
            self.hf, vocab_size=self.vocab_size, stop_token_ids=self.eos)
        self.compiler = xgr.GrammarCompiler(self.tok, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_json_schema(
            spec, any_whitespace=False, separators=(",", ":"), strict_mode=kind != "json_object")

    def walk(self, grammar: Any, tokens: list[int], batch: int) -> list[float]:
        import xgrammar as xgr

        matchers = [xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
                    for _ in range(batch)]
        bitmask = xgr.allocate_token_bitmask(batch, self.vocab_size)
        runner = xgr.BatchGrammarMatcher()
        times = []
        for token in tokens:
            if batch == 1:
                t, _ = _timed(lambda: matchers[0].fill_next_token_bitmask(bitmask, 0))
            else:
                t, _ = _timed(lambda: runner.batch_fill_next_token_bitmask(matchers, bitmask))
            times.append(t)
            for row, matcher in enumerate(matchers):
                assert _allowed(bitmask, row, token), f"xgrammar masked out token {token}"
                assert matcher.accept_token(token)
        assert matchers[0].is_terminated() or _eos_allowed(matchers[0], bitmask, self.eos)
        return times


def _eos_allowed(matcher: Any, bitmask: Any, eos: list[int]) -> bool:
    matcher.fill_next_token_bitmask(bitmask, 0)
    return any(_allowed(bitmask, 0, e) for e in eos)


class LLGuidance:
    name = "llguidance"
    packages = ("llguidance",)

    def __init__(self, hf: Any, vocab_size: int, eos: list[int]) -> None:
        self.hf, self.vocab_size, self.eos = hf, vocab_size, eos

    def info(self) -> None:
        import llguidance
        import llguidance.hf

        self.tok = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.vocab_size,
                                                eos_token=self.eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec: str) -> Any:
        from llguidance import LLMatcher

        if kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        else:
            grammar = LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_flexible": False})
        matcher = LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walk(self, grammar: Any, tokens: list[int], batch: int) -> list[float]:
        import llguidance.torch as llt

        matchers = [grammar.deep_copy() for _ in range(batch)]
        pairs = [(m, i) for i, m in enumerate(matchers)]
        bitmask = llt.allocate_token_bitmask(batch, self.vocab_size)
        times = []
        for token in tokens:
            if batch == 1:
                t, _ = _timed(lambda: llt.fill_next_token_bitmask(matchers[0], bitmask, 0))
            else:
                t, _ = _timed(lambda: llt.fill_next_token_bitmask_par(
                    self.executor, pairs, bitmask))
            times.append(t)
            for row, matcher in enumerate(matchers):
                assert _allowed(bitmask, row, token), f"llguidance masked out token {token}"
                assert matcher.consume_token(token), matcher.get_error()
        last = matchers[0]
        assert last.is_stopped() or last.is_accepting()
        return times


# ---- the measurements --------------------------------------------------------------------


def _cases() -> list[tuple[str, str, str, str]]:
    """(case, kind, spec, valid text)."""
    return [("json_object", "json_object", '{"type":"object"}', _compact(DOCUMENT)),
            ("json_schema", "json_schema", json.dumps(SCHEMA), _compact(DOCUMENT)),
            ("regex", "regex", REGEX, REGEX_TEXT)]


def measure(engine: Any, hf: Any, repeats: int) -> dict[str, Any]:
    info_s, _ = _best(repeats, engine.info)
    out: dict[str, Any] = {"tokenizer_info_ms": 1e3 * info_s}
    for case, kind, spec, text in _cases():
        compile_s, grammar = _best(repeats, lambda k=kind, s=spec: engine.compile(k, s))
        tokens = list(hf(text, add_special_tokens=False).input_ids)
        engine.walk(grammar, tokens, 1)  # warm-up (lazily built lexer states, threads)
        single = engine.walk(grammar, tokens, 1)
        batched = engine.walk(grammar, tokens, BATCH)
        out[case] = {"compile_ms": 1e3 * compile_s, "walk_tokens": len(tokens),
                     "fill_b1": _stats_us(single), f"fill_b{BATCH}": _stats_us(batched)}
    return out


def package_weight(names: tuple[str, ...]) -> dict[str, Any]:
    """Installed megabytes of each package (its RECORD's files) and in all."""
    sizes = {}
    for name in names:
        dist = metadata.distribution(name)
        total = sum((f.size or 0) for f in dist.files or [])
        sizes[f"{name} {dist.version}"] = round(total / 2**20, 1)
    return {"packages_mb": sizes, "total_mb": round(sum(sizes.values()), 1)}


def tiny_tokenizer() -> Any:
    """A byte-level BPE of ~600 tokens trained on the bench's own texts."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(TINY_CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                                                eos_token="</s>")


def default_tokenizer() -> Any:
    from backends.default_model import default_model_path
    from backends.native.loading.loader import load_checkpoint
    from backends.native.loading.tokenizer_loading import load_tokenizer

    return load_tokenizer(load_checkpoint(default_model_path())).hf


def print_table(results: dict[str, Any]) -> None:
    head = (f"{'tokenizer':<10} {'engine':<11} {'info ms':>8} {'case':<12} {'compile ms':>10} "
            f"{'b1 mean/p99 us':>16} {f'b{BATCH} mean/p99 us':>17}")
    print(head)
    print("-" * len(head))
    for tok_name, engines in results["tokenizers"].items():
        for engine, fig in engines.items():
            for case, *_ in _cases():
                c = fig[case]
                b1, bn = c["fill_b1"], c[f"fill_b{BATCH}"]
                print(f"{tok_name:<10} {engine:<11} {fig['tokenizer_info_ms']:>8.1f} {case:<12} "
                      f"{c['compile_ms']:>10.1f} {b1['mean_us']:>7.0f}/{b1['p99_us']:<8.0f} "
                      f"{bn['mean_us']:>8.0f}/{bn['p99_us']:<8.0f}")
    for engine, weight in results["dependencies"].items():
        print(f"{engine}: {weight['total_mb']} MB installed ({weight['packages_mb']})")


def installed(package: str) -> bool:
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        print(f"{package} is not installed: skipped")
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for build times")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    configure_threads(args.threads, bind=False)
    facts = machine_facts(None, args.threads)
    print(facts_line(facts))
    results: dict[str, Any] = {"batch": BATCH, "tokenizers": {}, "dependencies": {}}
    engines = [cls for cls in (XGrammar, LLGuidance) if installed(cls.packages[0])]
    for tok_name, hf in (("smollm2", default_tokenizer()), ("tiny", tiny_tokenizer())):
        vocab, eos = len(hf), [hf.eos_token_id]
        results["tokenizers"][tok_name] = {"vocab_size": vocab}
        for cls in engines:
            engine = cls(hf, vocab, eos)
            results["tokenizers"][tok_name][cls.name] = measure(engine, hf, args.repeats)
    for cls in engines:
        results["dependencies"][cls.name] = package_weight(cls.packages)
    tables = {k: {e: v for e, v in t.items() if e != "vocab_size"}
              for k, t in results["tokenizers"].items()}
    print_table({**results, "tokenizers": tables})
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
