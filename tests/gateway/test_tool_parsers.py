"""Tool calling without a model: spec validation, template detection, the forcing schema,
and calls parsed from text whole and streamed in every split."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai.tools import ToolCallParser, ToolSpecError, detect_format, plan_tools
from gateway.openai.tools.forced import forced_schema
from gateway.openai.tools.spec import check_tools

NAMES = {"get_weather", "add"}
ID = re.compile(r"call_[0-9a-f]{24}")

# (format, text, content expected, [(name, raw arguments)] expected)
CASES = [
    ("hermes",
     'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"units": ["c", 1.5e3, null, true]}}\n</tool_call>',
     "Let me look.\n", [("get_weather", '{"city": "Paris", "units": ["c", 1.5e3, null, true]}')]),
    ("hermes",
     '<tool_call>{"name": "add", "arguments": {"a": 1, "b": -2}}</tool_call>\n'
     '<tool_call>{"arguments": {"city": "}</tool_call>\\"x"}, "name": "get_weather"}</tool_call>',
     "", [("add", '{"a": 1, "b": -2}'), ("get_weather", '{"city": "}</tool_call>\\"x"}')]),
    ("hermes", '<tool_call>{"name": "add"}</tool_call> Done.', " Done.", [("add", "{}")]),
    ("hermes", 'I used <tool_ca, then <tool_call>{"name": "add", "arguments": {"a": 2}}',
     "I used <tool_ca, then ", [("add", '{"a": 2}')]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json",
     '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "arguments": {}}',
     "", [("add", '{"a": 1}'), ("add", "{}")]),
    ("mistral",
     '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
     '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
     "", [("add", '{"a": 1}'), ("get_weather", '{"city": "Rome"}')]),
    ("mistral", '[{"name": "add", "arguments": {"a": [1, {"b": "]"}]}}]',  # marker decoded away
     "", [("add", '{"a": [1, {"b": "]"}]}')]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{"city": "é😀"}',
     "", [("add", '{"a": 1}'), ("get_weather", '{"city": "é😀"}')]),
    ("forced", '[{"name": "add", "arguments": {"a": 1, "s": "x\\u00e9\\n"}}, '
               '{"name": "get_weather", "arguments": {}}]',
     "", [("add", '{"a": 1, "s": "x\\u00e9\\n"}'), ("get_weather", "{}")]),
]

# Not calls: every character comes back as content, and no call is announced.
MALFORMED = [
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # undeclared
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
    ("hermes", '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>'),
    ("hermes", '<tool_call>{"nam'),  # cut short before the name
    ("hermes", "<tool_call>"),
    ("hermes", "a <tool_call"),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", "The answer is {x}."),
    ("mistral", "[1, 2, 3]"),
    ("mistral", "[TOOL_CALLS]nope[ARGS]{}"),
    ("mistral", "[TOOL_CALLS] oops"),
]


def run(parser: ToolCallParser, chunks: list[str]) -> tuple[str, dict[int, dict[str, Any]]]:
    """Feed `chunks`; the content and, per call index, its streamed id, name and arguments."""
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    streamed: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for item in delta.tool_calls:
            fn = item["function"]
            if "id" in item:  # the first delta of a call: announced once, arguments ""
                assert item["index"] not in streamed and item["index"] == len(streamed)
                assert item["type"] == "function" and fn["arguments"] == ""
                streamed[item["index"]] = {"id": item["id"], "name": fn["name"], "arguments": ""}
            else:
                assert set(item) == {"index", "function"} and set(fn) == {"arguments"}
                assert fn["arguments"]
                streamed[item["index"]]["arguments"] += fn["arguments"]
    return "".join(d.content for d in deltas), streamed


def check(fmt: str, chunks: list[str], content: str, calls: list[tuple[str, str]]) -> None:
    parser = ToolCallParser(fmt, NAMES)
    got_content, streamed = run(parser, chunks)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == calls
    for i, call in enumerate(parser.calls):
        assert ID.fullmatch(call["id"]) and call["type"] == "function"
        assert streamed[i] == {"id": call["id"], **call["function"]}
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert len({c["id"] for c in parser.calls}) == len(parser.calls)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_calls_whole_char_by_char_and_chunked(
    fmt: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    check(fmt, [text], content, calls)
    check(fmt, list(text), content, calls)
    rng = random.Random(len(text))
    for _ in range(30):
        check(fmt, split(text, [rng.randrange(len(text)) for _ in range(rng.randint(1, 12))]),
              content, calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES + [(f, t, t, []) for f, t in MALFORMED]),
       cuts=st.lists(st.integers(0, 200), max_size=20))
def test_any_split_gives_the_same_answer(case: tuple, cuts: list[int]) -> None:
    fmt, text, content, calls = case
    check(fmt, split(text, cuts), content, calls)


PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}",
          "[", "]", '"name"', '"arguments"', '"parameters"', ": ", ", ", ";", '"add"', "add",
          '"x"', "1", "tru", " ", "\n", "hi", "<tool", "\\", '{"name": "add", "arguments": ',
          '{"x": [1, "]}"]}', "}",
          # whole calls, so that the texts hold some
          '<tool_call>{"name": "add", "arguments": {"x": "</tool_call>"}}</tool_call>',
          '[TOOL_CALLS]add[ARGS]{"x": 1}', '[TOOL_CALLS][{"name": "add", "arguments": {}}]',
          '<|python_tag|>{"name": "add", "parameters": {"x": "}"}}',
          '[{"name": "add", "arguments": {"y": null}}]']


@settings(max_examples=400, deadline=None)
@given(fmt=st.sampled_from(["hermes", "llama3_json", "mistral", "forced"]),
       pieces=st.lists(st.sampled_from(PIECES), max_size=30),
       cuts=st.lists(st.integers(0, 120), max_size=12))
def test_any_text_parses_the_same_in_any_split(fmt: str, pieces: list[str],
                                               cuts: list[int]) -> None:
    """Never an exception; the split never changes the answer; fragments add up."""
    text = "".join(pieces)
    whole = ToolCallParser(fmt, NAMES)
    content, _ = run(whole, [text])
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    if all(_is_object(arguments) for _, arguments in expected):
        check(fmt, split(text, cuts), content, expected)
    streamed_parser = ToolCallParser(fmt, NAMES)
    assert run(streamed_parser, split(text, cuts))[0] == content
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in streamed_parser.calls] == expected


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_calls_are_content(fmt: str, text: str) -> None:
    check(fmt, [text], text, [])
    check(fmt, list(text), text, [])


def test_content_leaves_at_once_and_a_call_as_soon_as_its_name_is_known() -> None:
    parser = ToolCallParser("hermes", NAMES)
    assert parser.feed("Sure. <tool").content == "Sure. "  # only a possible marker is held
    assert parser.feed("box> ").content == "<toolbox> "
    step = parser.feed('<tool_call>{"name": "get_weather"')
    assert step.content == "" and step.tool_calls == []  # the name may still go on
    step = parser.feed(', "arguments": {"ci')
    assert step.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert step.tool_calls[1] == {"index": 0, "function": {"arguments": '{"ci'}}
    assert parser.feed('ty": "Paris"').tool_calls == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"'}}]
    assert parser.feed("}").tool_calls == [{"index": 0, "function": {"arguments": "}"}}]
    rest = parser.feed("}</tool_call>")
    assert rest.content == "" and rest.tool_calls == []
    assert parser.finish().content == ""
    assert parser.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_call_cut_short_keeps_what_was_streamed() -> None:
    """max_tokens can end the text inside the arguments: the call stays as far as it came
    (the finish reason says "length"), and what was streamed is what `calls` holds."""
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b'
    parser = ToolCallParser("hermes", NAMES)
    content, streamed = run(parser, list(text))
    assert content == "" and parser.calls[0]["function"]["arguments"] == '{"a": 1, "b'
    assert streamed[0]["arguments"] == '{"a": 1, "b'


def test_a_call_that_breaks_after_it_was_announced_ends_there() -> None:
    parser = ToolCallParser("hermes", NAMES)
    content, streamed = run(parser, list('<tool_call>{"name": "add", "arguments": {"a": tru}}'))
    assert parser.calls[0]["function"]["arguments"] == streamed[0]["arguments"] == '{"a": tru'
    assert content == "}}"


def test_string_encoded_arguments_are_decoded() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    check("hermes", [text], "", [("add", '{"a": 1}')])
    check("hermes", list(text), "", [("add", '{"a": 1}')])


# ---- the schema that forces calls -------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"]}}}
PYDANTIC_LIKE = {"type": "function", "function": {
    "name": "book", "parameters": {
        "type": "object", "$defs": {"Guest": {"type": "object", "properties": {
            "name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}},
        "properties": {"guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"}},
                       "then": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["guests"]}}}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, PYDANTIC_LIKE, NO_ARGS]


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def test_forced_schema_accepts_valid_calls_only() -> None:
    schema = forced_schema(check_tools(TOOLS), parallel=False)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = jsonschema.Draft202012Validator(schema)
    good = [
        [call("get_weather", {"city": "Paris"})],
        [call("get_weather", {"city": "Paris", "days": 3})],
        [call("book", {"guests": [{"name": "Ann"}], "then": {"guests": []}})],
        [call("now", {})],
    ]
    for value in good:
        assert ok.is_valid(value), value
    bad = [
        [],  # a call is required
        [call("get_weather", {"city": "Paris"}), call("now", {})],  # not parallel
        [call("get_wether", {"city": "Paris"})],
        [call("get_weather", {})],
        [call("get_weather", {"city": 3})],
        [call("get_weather", {"city": "Paris", "days": 0})],
        [call("get_weather", {"city": "Paris", "extra": 1})],  # undeclared argument
        [{**call("now", {}), "id": "x"}],
        [{"name": "now"}],
        [call("book", {"guests": [{"nam": "Ann"}]})],
        [call("book", {"guests": [], "then": {"guests": [{}]}})],
        [call("now", {"a": 1})],
        call("now", {}),
    ]
    for value in bad:
        assert not ok.is_valid(value), value
    parallel = jsonschema.Draft202012Validator(forced_schema(check_tools(TOOLS), parallel=True))
    assert parallel.is_valid([call("now", {}), call("get_weather", {"city": "Oslo"})])


def test_forced_plan_named_and_required() -> None:
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True,
                       None)
    assert named.structured is not None and named.structured.kind == "json_schema"
    schema = json.loads(named.structured.spec)
    assert jsonschema.Draft202012Validator(schema).is_valid([call("get_weather", {"city": "a"})])
    assert not jsonschema.Draft202012Validator(schema).is_valid([call("now", {})])
    assert schema["maxItems"] == 1  # one call to the named function
    required = plan_tools(TOOLS, "required", True, None)
    assert "maxItems" not in json.loads(required.structured.spec)
    assert plan_tools(TOOLS, "auto", True, None).structured is None
    # What the grammar lets through, the forced parser reads back.
    text = json.dumps([call("get_weather", {"city": "Paris"}), call("now", {})])
    parser = required.parser()
    content, _ = run(parser, list(text))
    assert content == "" and [c["function"]["name"] for c in parser.calls] == [
        "get_weather", "now"]
    assert json.loads(parser.calls[0]["function"]["arguments"]) == {"city": "Paris"}
    named_parser = named.parser()
    run(named_parser, [json.dumps([call("now", {})])])
    assert named_parser.calls == []  # the named parser knows only its function


def test_forced_schema_compiles_in_the_grammar_engine() -> None:
    llguidance = pytest.importorskip("llguidance")
    for parallel in (True, False):
        schema = forced_schema(check_tools(TOOLS), parallel)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"lenient": False})
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""


# ---- templates and plans ----------------------------------------------------------------

QWEN_LIKE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}"
             "{{ t | tojson }}{%- endfor %}</tools> answer with <tool_call></tool_call>"
             "{%- endif %}{%- for m in messages %}...{%- endfor %}")
MISTRAL_LIKE = ("{%- if tools is not none %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
                "[/AVAILABLE_TOOLS]{%- endif %}{%- for m in messages %}{%- if m.tool_calls %}"
                "[TOOL_CALLS]{%- endif %}{%- endfor %}")
LLAMA31_LIKE = ("{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
                "{{- '<|start_header_id|>ipython<|end_header_id|>' }}{{- '<|python_tag|>' }}")
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
           "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")


def test_format_detection_and_override() -> None:
    assert detect_format(QWEN_LIKE) == "hermes"
    assert detect_format(MISTRAL_LIKE) == "mistral"
    assert detect_format(LLAMA31_LIKE) == "llama3_json"
    assert detect_format(SMOLLM2) == detect_format(None) == "hermes"
    for template, native in ((QWEN_LIKE, True), (MISTRAL_LIKE, True), (LLAMA31_LIKE, True),
                             (SMOLLM2, False), (None, False)):
        plan = plan_tools([WEATHER], "auto", True, template)
        assert plan.native is native
        assert plan.tools == ([WEATHER] if native else None)
    assert plan_tools([WEATHER], None, True, QWEN_LIKE, "mistral").format == "mistral"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        plan_tools([WEATHER], None, True, QWEN_LIKE, "pythonic")


def test_tool_choice_none_and_no_tools() -> None:
    none = plan_tools([WEATHER], "none", True, QWEN_LIKE)
    assert none.parser() is None and none.tools is None and none.structured is None
    history_only = plan_tools([], None, True, SMOLLM2)
    assert history_only.parser() is None and history_only.tools is None
    auto = plan_tools([WEATHER], None, True, QWEN_LIKE)
    assert isinstance(auto.parser(), ToolCallParser) and auto.parser() is not auto.parser()


def test_default_parameters() -> None:
    plan = plan_tools([NO_ARGS], "auto", True, QWEN_LIKE)
    assert plan.tools == [{"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}]


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25C"},
]


def test_native_history_parses_arguments_and_fixes_mistral_ids() -> None:
    messages = plan_tools([WEATHER], "auto", True, QWEN_LIKE).template_messages(HISTORY)
    assert messages[2]["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}
    assert messages[3] == HISTORY[3] and messages[0] == HISTORY[0]
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    mistral = plan_tools([WEATHER], "auto", True, MISTRAL_LIKE).template_messages(HISTORY)
    ids = [c["id"] for c in mistral[2]["tool_calls"]]
    assert all(re.fullmatch(r"[a-zA-Z0-9]{9}", i) for i in ids) and ids[0] != ids[1]
    assert [mistral[3]["tool_call_id"], mistral[4]["tool_call_id"]] == ids


def test_folded_history_for_a_template_without_tools() -> None:
    plan = plan_tools([WEATHER], "auto", False, SMOLLM2)
    messages = plan.template_messages(HISTORY)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER["function"]) in system and "<tool_call>" in system
    assert "at most one" in system
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                           '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                           '{"city": "Rome"}}\n</tool_call>'}
    assert messages[3]["content"] == (
        "<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response>")
    # The folded calls are exactly what the hermes parser reads back.
    parser = plan.parser()
    run(parser, [messages[2]["content"]])
    assert [json.loads(c["function"]["arguments"]) for c in parser.calls] == [
        {"city": "Paris"}, {"city": "Rome"}]
    no_system = plan.template_messages(HISTORY[1:])
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools")
    silent = plan_tools([WEATHER], "none", False, SMOLLM2).template_messages(HISTORY)
    assert "# Tools" not in silent[0]["content"] and "<tool_call>" in silent[2]["content"]


def test_malformed_history_call_is_a_spec_error() -> None:
    plan = plan_tools([WEATHER], "auto", True, SMOLLM2)
    bad = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}]
    with pytest.raises(ToolSpecError) as err:
        plan.template_messages(bad)
    assert err.value.param == "messages[0].tool_calls[0]"


# ---- validation -------------------------------------------------------------------------

def fn(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(("tools", "choice", "param", "words"), [
    ("get_weather", None, "tools", "must be a list"),
    ([{"type": "retrieval"}], None, "tools[0].type", "must be 'function'"),
    (["x"], None, "tools[0]", "must be an object"),
    ([{"type": "function"}], None, "tools[0].function", "must be an object"),
    ([fn(name="has space")], None, "tools[0].function.name", "1 to 64 letters"),
    ([fn(name="x" * 65)], None, "tools[0].function.name", "1 to 64"),
    ([fn(description="no name")], None, "tools[0].function.name", "1 to 64"),
    ([fn(name="a"), fn(name="a")], None, "tools[1].function.name", "unique"),
    ([fn(name="a", parameters=[])], None, "tools[0].function.parameters", "JSON Schema object"),
    ([fn(name="a", parameters={"type": "string"})], None, "tools[0].function.parameters.type",
     "must be 'object'"),
    ([fn(name="a", parameters={"type": "object", "properties": []})], None,
     "tools[0].function.parameters.properties", "mapping"),
    ([fn(name="a", parameters={"type": "object", "required": "x"})], None,
     "tools[0].function.parameters.required", "list of property names"),
    ([fn(name="a", description=3)], None, "tools[0].function.description", "string"),
    ([fn(name="a")], "sometimes", "tool_choice", "must be one of none, auto, required"),
    ([fn(name="a")], {"type": "function", "function": {"name": "b"}}, "tool_choice",
     "'b', which is not among the tools (declared: 'a')"),
    ([fn(name="a")], {"type": "function", "name": "a"}, "tool_choice", "must look like"),
    ([], "required", "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "a"}}, "tool_choice", "declared: none"),
])
def test_spec_errors_name_the_field(tools: Any, choice: Any, param: str, words: str) -> None:
    with pytest.raises(ToolSpecError) as err:
        plan_tools(tools, choice, True, None)
    assert err.value.param == param
    assert words in err.value.message


def test_models_file_tool_call_parser(tmp_path: Any) -> None:
    from gateway.models_file import ConfigError, load_config_file, model_plan

    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - name: m\n    model_id: /x\n    tool_call_parser: mistral\n")
    plan = model_plan(load_config_file(path).models[0], "native", {})
    assert plan.tool_call_parser == "mistral"
    assert plan_tools([WEATHER], None, True, QWEN_LIKE, plan.tool_call_parser).format == "mistral"
    path.write_text("models:\n  - name: m\n    model_id: /x\n    tool_call_parser: pythonic\n")
    with pytest.raises(ConfigError, match=r"models\[0\]\.tool_call_parser"):
        load_config_file(path)
