"""Tokenizer, chat templates, IncrementalDetokenizer and StopChecker."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from backends.base import GenerationRequest
from backends.default_model import default_model_path
from backends.native.loading.loader import load_checkpoint
from backends.native.loading.tokenizer_loading import load_tokenizer
from backends.text.prompt_checks import encode_request
from backends.text.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
)
from gateway.openai.tools import plan_tools

torch.set_num_threads(1)

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The café serves crème brûlée and naïve résumés.",
    "中文分词很有趣，我们喜欢中文。",
    "Emoji: 😀 🎉 👍🏽 and more 😀😀.",
    "def f(x):\n    return x * 2  # code\n",
    "The quick brown fox jumps over the lazy dog. 1234567890",
]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Hello, café 中文 😀"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": ""}],
]


def train_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", raw.token_to_id("<s>"))]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML
    return hf


def save_tiny_checkpoint(folder: Path, hf: transformers.PreTrainedTokenizerBase) -> None:
    hf.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=hf.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    gen = transformers.GenerationConfig(eos_token_id=[hf.eos_token_id, im_end])
    gen.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_tok")
    save_tiny_checkpoint(folder, train_tiny_tokenizer())
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return load_tokenizer(load_checkpoint(str(tiny_dir)))


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer(load_checkpoint(default_model_path()))


@pytest.fixture(scope="module")
def smol_reference() -> transformers.PreTrainedTokenizerBase:
    folder, name = os.path.split(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


# ---- Tokenizer ---------------------------------------------------------------------------


def test_tiny_tokenizer_basics(tiny: Tokenizer, tiny_dir: Path) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    text = "Hello café 中文 😀"
    assert tiny.encode(text) == reference(text).input_ids
    assert tiny.encode(text)[0] == tiny.bos_token_id == reference.bos_token_id
    assert tiny.vocab_size == len(reference)
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert tiny.eos_token_ids == frozenset({reference.eos_token_id, im_end})
    assert tiny.chat_template == CHATML
    assert tiny.is_special(im_end) and tiny.is_special(tiny.bos_token_id)
    assert not tiny.is_special(tiny.encode("Hello")[1])
    assert tiny.decode(tiny.encode(text)) == text
    assert tiny.decode(tiny.encode(text), skip_special_tokens=False) == "<s>" + text


def test_tiny_tokenizer_splits_characters_across_tokens(tiny: Tokenizer) -> None:
    """The detokenizer tests below are only meaningful if some character spans tokens."""
    ids = tiny.encode("👍🏽")[1:]
    assert any("\ufffd" in tiny.decode([i]) for i in ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_matches_transformers_tiny(
    tiny: Tokenizer, tiny_dir: Path, messages: list[dict], add_generation_prompt: bool
) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    expected = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert tiny.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected


def test_encode_chat_matches_transformers_default_model(
    smol: Tokenizer, smol_reference: transformers.PreTrainedTokenizerBase
) -> None:
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = smol_reference.apply_chat_template(
                messages, add_generation_prompt=add, tokenize=True, return_dict=False
            )
            assert smol.encode_chat(messages, add_generation_prompt=add) == expected


def test_default_model_tokenizer_follows_gguf_metadata(smol: Tokenizer) -> None:
    # transformers' GGUF conversion makes <|im_start|> the EOS and adds BOS; the file says not.
    assert smol.eos_token_ids == frozenset({2})
    assert smol.bos_token_id == 1
    assert smol.encode("Hello world")[0] != 1
    assert smol.chat_template and "<|im_start|>" in smol.chat_template
    assert smol.vocab_size == 49152
    assert smol.is_special(2) and not smol.is_special(smol.encode("Hello")[0])
    text = "Hello , world . don 't 中文 😀"
    assert smol.decode(smol.encode(text)) == text


def test_chat_template_errors(tiny: Tokenizer, tiny_dir: Path) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: tool"):
        tiny.encode_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        tiny.encode_chat([{"role": "user"}])
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(hf).encode_chat([{"role": "user", "content": "hi"}])


def test_default_template_rejects_bad_roles(smol: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        smol.encode_chat([{"role": "user"}])


# ---- Tools in the chat template ----------------------------------------------------------

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
]


def test_a_template_with_tools_receives_them(tiny_dir: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    hf.chat_template = TOOLS_TEMPLATE
    tok = Tokenizer(hf)
    plan = plan_tools([WEATHER], "auto", True, TOOLS_TEMPLATE)
    assert plan.tools == [WEATHER]
    messages = plan.template_messages(TOOL_HISTORY)
    expected = hf.apply_chat_template(messages, tools=plan.tools, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    ids = tok.encode_chat(messages, tools=plan.tools)
    assert ids == expected
    request = GenerationRequest("r", messages=messages, tools=plan.tools)
    assert encode_request(tok, request) == expected
    text = tok.decode(ids, skip_special_tokens=False)
    assert 'Tools: get_weather{"type": "object", "properties": {"city": {"type": ' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18C and sunny" in text
    without = tok.encode_chat(messages)
    assert without != ids and "Tools:" not in tok.decode(without)


def test_default_model_renders_a_folded_tool_history(
    smol: Tokenizer, smol_reference: transformers.PreTrainedTokenizerBase
) -> None:
    """SmolLM2's template knows nothing of tools: a call without content breaks it, so the
    plan writes definitions, calls and results as text it can render."""
    with pytest.raises(ChatTemplateError):
        smol.encode_chat(TOOL_HISTORY)
    plan = plan_tools([WEATHER], "auto", True, smol.chat_template)
    assert plan.tools is None and not plan.native
    messages = plan.template_messages(TOOL_HISTORY)
    ids = smol.encode_chat(messages, tools=plan.tools)
    assert ids == smol_reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = smol.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text and "SmolLM" not in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n18C and sunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text


# ---- IncrementalDetokenizer --------------------------------------------------------------


def stream(tok: Tokenizer, ids: Sequence[int], prompt: Sequence[int] | None = None,
           skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, list(prompt) if prompt else None, skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    assert detok.text == "".join(deltas)
    return deltas


FIXTURE_OK = [HealthCheck.function_scoped_fixture]  # module-scoped tokenizers only
TEXT = st.text(alphabet=st.sampled_from(list("ab xé中文😀👍🏽\n,.!") + ["🎉"]), max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(ids=st.lists(st.integers(0, 399), max_size=25), skip=st.booleans())
def test_detokenizer_random_ids(tiny: Tokenizer, ids: list[int], skip: bool) -> None:
    ids = [i % tiny.vocab_size for i in ids]
    deltas = stream(tiny, ids, skip_special_tokens=skip)
    full = tiny.decode(ids, skip_special_tokens=skip)
    if "\ufffd" not in full:
        assert "".join(deltas) == full
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(text=TEXT)
def test_detokenizer_round_trips_text(tiny: Tokenizer, text: str) -> None:
    ids = tiny.encode(text)[1:]  # without BOS
    deltas = stream(tiny, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE_OK)
@given(prompt=TEXT, completion=TEXT)
def test_detokenizer_after_prompt(tiny: Tokenizer, prompt: str, completion: str) -> None:
    prompt_ids = tiny.encode(prompt)
    ids = tiny.encode(completion)[1:]
    deltas = stream(tiny, ids, prompt=prompt_ids)
    prompt_text = tiny.decode(prompt_ids)
    full = tiny.decode(prompt_ids + ids)
    if "\ufffd" not in full:
        assert prompt_text + "".join(deltas) == full


def test_detokenizer_default_model(smol: Tokenizer) -> None:
    text = "Héllo 中文 😀 wörld! 👍🏽 done."
    ids = smol.encode(text)
    deltas = stream(smol, ids, prompt=smol.encode_chat([{"role": "user", "content": "hi"}]))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    eos = stream(smol, [*ids[:3], 2])
    assert eos[-1] == "" and "".join(eos) == smol.decode(ids[:3])
    assert "<|im_end|>" in "".join(stream(smol, [*ids[:3], 2], skip_special_tokens=False))


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE_OK)
@given(ids=st.lists(st.integers(0, 49151), max_size=12), skip=st.booleans())
def test_window_decode_is_transformers_decode(
    tiny: Tokenizer, smol: Tokenizer, ids: list[int], skip: bool,
) -> None:
    """The streaming window's decode calls `tokenizers` directly: the same text as
    transformers' decode without clean-up, special tokens and split characters included."""
    for tokenizer in (tiny, smol):
        assert tokenizer._window_decoder is not None
        window = [i % tokenizer.vocab_size for i in ids]
        want = tokenizer.hf.decode(window, skip_special_tokens=skip,
                                   clean_up_tokenization_spaces=False)
        assert tokenizer.decode_window(window, skip_special_tokens=skip) == want


# ---- StopChecker -------------------------------------------------------------------------


def truncate_at_first_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Reference: cut before the stop occurrence that ends first (the longest on a tie)."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def run_stop_checker(stops: Sequence[str], deltas: Sequence[str]) -> tuple[str, bool]:
    checker = StopChecker(stops)
    out: list[str] = []
    for delta in deltas:
        emitted, stopped = checker.feed(delta)
        out.append(emitted)
        if stopped:
            assert checker.flush() == ""
            return "".join(out), True
    return "".join(out) + checker.flush(), False


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc!", max_size=24),
    stops=st.lists(st.text(alphabet="abc!", max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 24), max_size=10),
)
def test_stop_checker_any_split(text: str, stops: list[str], cuts: list[int]) -> None:
    assert run_stop_checker(stops, split(text, cuts)) == truncate_at_first_stop(text, stops)


def first_stop_string(text: str, stops: Sequence[str]) -> str | None:
    """Reference: the stop string truncate_at_first_stop cuts at."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            return max(done, key=len)
    return None


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc!", max_size=24),
    stops=st.lists(st.text(alphabet="abc!", max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 24), max_size=10),
)
def test_stop_checker_names_the_stop_that_ended_it(text: str, stops: list[str],
                                                   cuts: list[int]) -> None:
    checker = StopChecker(stops)
    for delta in split(text, cuts):
        if checker.feed(delta)[1]:
            break
    assert checker.matched == first_stop_string(text, stops)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc!", max_size=24),
    stops=st.lists(st.text(alphabet="abc!", min_size=1, max_size=4), max_size=3),
)
def test_stop_checker_never_emits_partial_stop(text: str, stops: list[str]) -> None:
    """Whatever comes next, nothing already emitted is ever part of a stop string."""
    checker = StopChecker(stops)
    emitted = ""
    for i, ch in enumerate(text):
        out, stopped = checker.feed(ch)
        emitted += out
        if stopped:
            break
        for stop in stops:
            assert truncate_at_first_stop(text[: i + 1] + stop, stops)[0].startswith(emitted)


def test_stop_checker_examples() -> None:
    checker = StopChecker(["</answer>", "\n\n"])
    assert checker.feed("The answer is 4<") == ("The answer is 4", False)
    assert checker.feed("/ans") == ("", False)
    assert checker.feed("wer> more") == ("", True)
    assert checker.feed("x") == ("", True)
    checker = StopChecker(["STOP"])
    assert checker.feed("go ST") == ("go ", False)
    assert checker.feed("OP") == ("", True)
    checker = StopChecker(["STOP"])
    assert checker.feed("go ST") == ("go ", False)
    assert checker.feed("AY") == ("STAY", False)
    assert checker.feed(" S") == (" ", False)
    assert checker.flush() == "S"
    checker = StopChecker(["", "zz"])
    assert checker.feed("abc") == ("abc", False)
    assert StopChecker([]).feed("anything") == ("anything", False)
