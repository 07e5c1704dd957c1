"""Structured outputs: grammars compiled by llguidance against real tokenizers, token masks.

The random walks pick a uniformly random allowed token at every step (what a model with random
weights does under the mask), so any hole in the masks shows up as output that does not parse.
"""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from backends.base import StructuredOutput
from backends.native.structured import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    TokenMasks,
    apply_token_bitmask,
)
from backends.text.tokenizer import Tokenizer

WALKS = 50
MAX_STEPS = 3000
STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 12},
        "status": {"enum": ["active", "inactive", "banned"]},
        "verified": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "level": {"type": "integer", "minimum": 1, "maximum": 5},
                "admin": {"type": "boolean"},
                "role": {"enum": ["dev", "ops"]},
            },
            "required": ["level", "admin", "role"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "status", "verified", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"(ERR|WARN|INFO)-[0-9]{2,4}: [a-z]{1,6}( [a-z]{1,6}){0,3}\."
TINY_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["a", "b"], "ok": true, "none": null}',
    "Hello world, this is a tiny corpus for a tiny tokenizer. 0123456789",
    "[1, 2.5, -3e4] {} [] : , \\\" \\n \\u00e9 café",
]


@pytest.fixture(scope="module")
def smol(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))


@pytest.fixture(scope="module")
def compiler(smol: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smol, smol.vocab_size)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    """A 300-token byte-level BPE with two EOS tokens (</s> and <|im_end|>)."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    raw.train_from_iterator(TINY_CORPUS, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_end|>"],
    )
    return Tokenizer(hf, extra_eos_token_ids=[hf.convert_tokens_to_ids("<|im_end|>")])


def unpack(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """Allowed token ids of one packed row, by plain bit arithmetic."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().flatten()


def random_walk(
    compiled: CompiledGrammar, masks: TokenMasks, tok: Tokenizer, rng: random.Random
) -> list[int]:
    """Tokens of one walk (EOS excluded): until the matcher terminates or EOS is chosen."""
    matcher, out = compiled.matcher(), []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated:
            return out
        allowed = unpack(masks.fill([matcher])[0], masks.vocab_size).tolist()
        assert allowed, "the mask allows nothing"
        token = rng.choice(allowed)
        assert matcher.accept(token)
        if token in tok.eos_token_ids:
            assert matcher.is_terminated
            return out
        out.append(token)
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {tok.decode(out)[:200]!r}")


def walks(compiled: CompiledGrammar, tok: Tokenizer, seed: int) -> list[str]:
    masks, rng = TokenMasks(tok.vocab_size), random.Random(seed)
    return [tok.decode(random_walk(compiled, masks, tok, rng)) for _ in range(WALKS)]


# ---- random walks: every output parses and validates ---------------------------------------


def test_json_schema_walks_validate(compiler: GrammarCompiler, smol: Tokenizer) -> None:
    compiled = compiler.compile(StructuredOutput("json_schema", json.dumps(STRICT_SCHEMA)))
    texts = walks(compiled, smol, seed=1)
    for text in texts:
        jsonschema.validate(json.loads(text), STRICT_SCHEMA)
    assert len(set(texts)) > WALKS // 2  # really random walks, not one forced answer


def test_json_object_walks_parse(tiny: Tokenizer) -> None:
    """Any object: on the tiny vocabulary, where a random string closes in reasonable time."""
    compiled = GrammarCompiler(tiny, tiny.vocab_size).compile(StructuredOutput("json_object"))
    for text in walks(compiled, tiny, seed=2):
        assert isinstance(json.loads(text), dict), text


def test_valid_documents_are_allowed_token_by_token(
    compiler: GrammarCompiler, smol: Tokenizer
) -> None:
    """The model's own tokenization of a valid answer is allowed at every step. (On a 49k
    vocabulary a random walk through a free string rarely closes it: the tiny one walks.)"""
    document = {"id": 42, "name": "Ada", "status": "banned", "verified": False,
                "tags": ["x", "yz"], "owner": {"level": 3, "admin": True, "role": "ops"}}
    text = json.dumps(document)
    masks = TokenMasks(smol.vocab_size)
    for kind, spec in [("json_object", ""), ("json_schema", json.dumps(STRICT_SCHEMA))]:
        matcher = compiler.compile(StructuredOutput(kind, spec)).matcher()  # type: ignore[arg-type]
        for token in smol.hf.encode(text):
            assert token in set(unpack(masks.fill([matcher])[0], smol.vocab_size).tolist())
            assert matcher.accept(token)
        assert matcher.is_terminated, kind  # the closing brace ends an object


def test_regex_walks_fullmatch(compiler: GrammarCompiler, smol: Tokenizer) -> None:
    compiled = compiler.compile(StructuredOutput("regex", REGEX))
    texts = walks(compiled, smol, seed=4)
    for text in texts:
        assert re.fullmatch(REGEX, text), text
    assert len(set(texts)) > WALKS // 2


def test_lark_walks(tiny: Tokenizer) -> None:
    lark = 'start: answer " " number\nanswer: "yes" | "no"\nnumber: /[1-9][0-9]?/\n'
    compiled = GrammarCompiler(tiny, tiny.vocab_size).compile(StructuredOutput("lark", lark))
    for text in walks(compiled, tiny, seed=5):
        assert re.fullmatch(r"(yes|no) [1-9][0-9]?", text), text


def test_json_uses_fixed_separators(compiler: GrammarCompiler, smol: Tokenizer) -> None:
    """`, ` and `: ` exactly (what json.dumps writes); no other whitespace, so a random model
    cannot spin on whitespace."""
    compiled = compiler.compile(StructuredOutput("json_object"))
    for text, ok in [('{"a": 1, "b": [1, 2]}', True), ('{"a":1}', False),
                     ('{"a":  1}', False), ('{ "a": 1}', False), ('{"a": 1}\n', False)]:
        matcher = compiled.matcher()
        assert all(matcher.accept(t) for t in smol.hf.encode(text)) is ok, text


# ---- termination and EOS -----------------------------------------------------------------


def test_eos_allowed_exactly_when_complete(tiny: Tokenizer) -> None:
    compiler = GrammarCompiler(tiny, tiny.vocab_size)
    masks = TokenMasks(tiny.vocab_size)
    matcher = compiler.compile(StructuredOutput("regex", "ab+")).matcher()
    eos = tiny.eos_token_ids
    assert len(eos) == 2
    for token in tiny.hf.encode("a"):
        assert not eos & set(unpack(masks.fill([matcher])[0], tiny.vocab_size).tolist())
        assert matcher.accept(token)
    assert not matcher.is_terminated
    assert matcher.accept(tiny.hf.encode("b")[0])
    allowed = set(unpack(masks.fill([matcher])[0], tiny.vocab_size).tolist())
    assert eos <= allowed and len(allowed) > len(eos)  # more "b" or an end
    assert not matcher.is_terminated
    assert matcher.accept(max(eos))  # either EOS ends it
    assert matcher.is_terminated


def test_terminated_when_nothing_but_eos_may_follow(
    compiler: GrammarCompiler, smol: Tokenizer
) -> None:
    matcher = compiler.compile(StructuredOutput("regex", "(yes|no)")).matcher()
    assert all(matcher.accept(t) for t in smol.hf.encode("yes"))
    assert matcher.is_terminated
    allowed = unpack(TokenMasks(smol.vocab_size).fill([matcher])[0], smol.vocab_size)
    assert set(allowed.tolist()) == set(smol.eos_token_ids)


def test_tokenizer_without_eos(tokenizer_dir: Path) -> None:
    """No EOS: a special token stands in for it; a grammar that cannot go on still ends."""
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    hf.eos_token = None
    tok = Tokenizer(hf)
    assert not tok.eos_token_ids
    compiled = GrammarCompiler(tok, tok.vocab_size).compile(StructuredOutput("regex", "(yes|no)!"))
    masks = TokenMasks(tok.vocab_size)
    texts = {tok.decode(random_walk(compiled, masks, tok, random.Random(s))) for s in range(20)}
    assert texts == {"yes!", "no!"}


def test_logits_narrower_than_tokenizer(smol: Tokenizer) -> None:
    """An LM head smaller than the tokenizer: masks have the logits' width."""
    narrow = smol.vocab_size - 40
    compiled = GrammarCompiler(smol, narrow).compile(StructuredOutput("json_object"))
    matcher = compiled.matcher()
    assert all(matcher.accept(t) for t in smol.hf.encode('{"a": "'))
    masks = TokenMasks(narrow)
    bitmask = masks.fill([matcher, None])
    assert bitmask.shape == (2, (narrow + 31) // 32)
    full = TokenMasks(smol.vocab_size)
    wide = GrammarCompiler(smol, smol.vocab_size).compile(StructuredOutput("json_object"))
    reference = wide.matcher()
    assert all(reference.accept(t) for t in smol.hf.encode('{"a": "'))
    expected = unpack(full.fill([reference])[0], narrow)
    assert torch.equal(unpack(bitmask[0], narrow), expected) and len(expected) > 1000
    logits = torch.zeros(2, narrow)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(torch.isfinite(logits[0]).nonzero().flatten(), expected)
    assert bool(torch.isfinite(logits[1]).all())


def test_rejected_token_returns_false_and_keeps_state(
    compiler: GrammarCompiler, smol: Tokenizer
) -> None:
    compiled = compiler.compile(StructuredOutput("json_schema", json.dumps(STRICT_SCHEMA)))
    matcher = compiled.matcher()
    assert matcher.accept(smol.hf.encode("{")[0])
    before = TokenMasks(smol.vocab_size).fill([matcher]).clone()
    bad = smol.hf.encode("hello")[0]
    assert not matcher.accept(bad)
    assert not matcher.accept(smol.vocab_size + 5)  # outside the vocabulary
    assert not matcher.is_terminated
    assert torch.equal(TokenMasks(smol.vocab_size).fill([matcher]), before)
    assert all(matcher.accept(t) for t in smol.hf.encode('"id": 7'))


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "spec", "needle"),
    [
        ("json_schema", '{"type": "object",', "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", '{"type": "object", "if": {"required": ["a"]}}', '"if"'),
        ("json_schema", '{"type": "objekt"}', "objekt"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
        ("regex", "a(b", "unclosed group"),
        ("regex", "", "empty"),
        ("lark", "start: undefined_rule\n", "undefined_rule"),
    ],
)
def test_bad_specs_raise_grammar_error(
    compiler: GrammarCompiler, kind: str, spec: str, needle: str
) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(StructuredOutput(kind, spec))  # type: ignore[arg-type]
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unsupported_keyword_message_says_what_to_do(compiler: GrammarCompiler) -> None:
    spec = json.dumps({"type": "object", "dependentRequired": {"a": ["b"]}})
    with pytest.raises(GrammarError, match="dependentRequired.*not support"):
        compiler.compile(StructuredOutput("json_schema", spec))


# ---- masks -------------------------------------------------------------------------------


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for row in range(out.shape[0]):
        for token in range(out.shape[1]):
            word = token // 32
            if word >= bitmask.shape[1] or not (int(bitmask[row, word]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(("vocab", "words"), [(100, 4), (64, 2), (77, 2), (3, 1)])
def test_apply_token_bitmask_matches_reference(vocab: int, words: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int32)
    bitmask[0] = -1  # all allowed
    bitmask[1, 0] = -(2**31)  # the sign bit alone: token 31
    expected = reference_apply(logits, bitmask)
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_fill_batch_rows(compiler: GrammarCompiler, smol: Tokenizer) -> None:
    compiled = compiler.compile(StructuredOutput("json_schema", json.dumps(STRICT_SCHEMA)))
    first, second = compiled.matcher(), compiled.matcher()
    assert all(second.accept(t) for t in smol.hf.encode('{"id": 12, "name": "x'))
    masks = TokenMasks(smol.vocab_size)
    assert masks.fill([None, None]) is None
    masks.fill([compiled.matcher() for _ in range(4)])  # dirty every row of the buffer
    batch = masks.fill([first, None, second, None]).clone()
    assert batch.shape == (4, (smol.vocab_size + 31) // 32) and batch.dtype == torch.int32
    assert torch.equal(batch[0], TokenMasks(smol.vocab_size).fill([first])[0])
    assert torch.equal(batch[2], TokenMasks(smol.vocab_size).fill([second])[0])
    assert bool((batch[1] == -1).all()) and bool((batch[3] == -1).all())
    opening = [smol.hf.decode([t]) for t in unpack(batch[0], smol.vocab_size).tolist()]
    assert opening and all(text.startswith("{") for text in opening)  # only ways to open it
    assert len(unpack(batch[2], smol.vocab_size)) > 1000  # inside a free string


def test_padded_vocabulary_never_allows_padding_tokens(smol: Tokenizer) -> None:
    """Logits wider than the tokenizer (a padded LM head): the extra ids are never allowed."""
    padded = smol.vocab_size + 45
    compiled = GrammarCompiler(smol, padded).compile(StructuredOutput("json_object"))
    matcher = compiled.matcher()
    assert all(matcher.accept(t) for t in smol.hf.encode('{"a": "'))
    bitmask = TokenMasks(padded).fill([matcher])
    assert bitmask.shape[1] == (padded + 31) // 32
    allowed = unpack(bitmask[0], padded)
    assert len(allowed) > 1000 and int(allowed.max()) < smol.vocab_size
    logits = torch.zeros(1, padded)
    apply_token_bitmask(logits, bitmask)
    assert bool(torch.isinf(logits[0, smol.vocab_size:]).all())


# ---- the cache ---------------------------------------------------------------------------


def test_cache_returns_the_same_compiled_grammar(smol: Tokenizer) -> None:
    compiler = GrammarCompiler(smol, smol.vocab_size, cache_size=2)
    a = StructuredOutput("regex", "[a-z]+")
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutput("regex", "[a-z]+")) is first
    assert compiler.compile(StructuredOutput("regex", "[a-y]+")) is not first
    assert compiler.compile(StructuredOutput("json_object", "ignored")) is compiler.compile(
        StructuredOutput("json_object"))
    assert compiler.compile(a) is not first  # evicted: two newer entries in a cache of two
    # matchers are independent states
    m1, m2 = first.matcher(), first.matcher()
    assert isinstance(m1, GrammarMatcher) and m1.accept(smol.hf.encode("a")[0])
    assert not m2.accept(smol.hf.encode("1")[0]) and m2.accept(smol.hf.encode("b")[0])


def test_cache_is_thread_safe(smol: Tokenizer) -> None:
    compiler = GrammarCompiler(smol, smol.vocab_size)
    spec = StructuredOutput("json_schema", json.dumps(STRICT_SCHEMA))
    results: list[CompiledGrammar] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert compiler.compile(spec) is results[0]
