"""ReasoningMarkers and ReasoningSplitter on the real test tokenizer plus think markers."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from backends.base import ReasoningSplit
from backends.text.detokenizer import IncrementalDetokenizer
from backends.text.reasoning import ReasoningSplitter
from backends.text.stop_checker import StopChecker
from backends.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def thinking_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf.add_tokens(["<think>", "</think>"], special_tokens=False)
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.hf.encode(text, add_special_tokens=False))


def _run(tok: Tokenizer, prompt: list[int], generated: list[int], stops: tuple[str, ...] = (),
         ) -> tuple[list[ReasoningSplit], str, ReasoningSplitter]:
    """The engine's order: detokenize, tell the splitter, stop-check, split what is released."""
    assert tok.reasoning_markers is not None
    detok = IncrementalDetokenizer(tok, prompt)
    stop = StopChecker(stops)
    splitter = ReasoningSplitter(tok.reasoning_markers, prompt)
    splits, raw = [], []
    for token in generated:
        piece = detok.add(token)
        splitter.token(token, piece)
        text, stopped = stop.feed(piece)
        raw.append(text)
        splits.append(splitter.release(text))
        if stopped:
            return splits, "".join(raw), splitter
    held = stop.flush()
    raw.append(held)
    splits.append(splitter.release(held))
    return splits, "".join(raw), splitter


def _joined(splits: list[ReasoningSplit]) -> tuple[str, str]:
    return "".join(s.reasoning for s in splits), "".join(s.content for s in splits)


def test_markers_come_from_the_added_tokens(
    thinking_tokenizer: Tokenizer, plain_tokenizer: Tokenizer,
) -> None:
    markers = thinking_tokenizer.reasoning_markers
    assert markers is not None
    assert thinking_tokenizer.hf.convert_ids_to_tokens([markers.start_id, markers.end_id]) == [
        "<think>", "</think>"]
    assert plain_tokenizer.reasoning_markers is None


def test_prompt_last_marker_decides_where_generation_starts(
    thinking_tokenizer: Tokenizer,
) -> None:
    m = thinking_tokenizer.reasoning_markers
    assert m is not None
    assert m.opens_in([5, m.start_id, 7])
    assert not m.opens_in([m.start_id, 9, m.end_id, 7])
    assert not m.opens_in([5, 6])


def test_split_on_token_ids_with_markers_dropped(thinking_tokenizer: Tokenizer) -> None:
    tok = thinking_tokenizer
    generated = _ids(tok, "<think>Let me see.</think>The answer is 4.")
    splits, raw, splitter = _run(tok, _ids(tok, "Q:"), generated)
    assert raw == "<think>Let me see.</think>The answer is 4."
    assert _joined(splits) == ("Let me see.", "The answer is 4.")
    # <think> Let me see . </think>: every token from marker to marker.
    assert splitter.reasoning_tokens == len(_ids(tok, "<think>Let me see.</think>"))


def test_marker_text_spelled_out_of_ordinary_tokens_is_content(
    thinking_tokenizer: Tokenizer,
) -> None:
    tok = thinking_tokenizer
    spelled = [t for piece in ("<", "think", ">", "hi") for t in _ids(tok, piece)]
    splits, raw, splitter = _run(tok, _ids(tok, "Q:"), spelled)
    assert raw == "<think>hi"
    assert _joined(splits) == ("", "<think>hi")
    assert splitter.reasoning_tokens == 0


def test_a_prompt_opened_reasoning_and_a_stop_string_held_across_the_marker(
    thinking_tokenizer: Tokenizer,
) -> None:
    tok = thinking_tokenizer
    m = tok.reasoning_markers
    assert m is not None
    prompt = _ids(tok, "Q:") + [m.start_id]
    generated = _ids(tok, "Hmm END</think>Yes END here")
    # "END" is held back while it could begin the stop string " ENDX", across the end marker.
    splits, raw, splitter = _run(tok, prompt, generated, stops=(" ENDX", " here"))
    assert raw == "Hmm END</think>Yes END"
    assert _joined(splits) == ("Hmm END", "Yes END")
    assert splitter.reasoning_tokens == len(_ids(tok, "Hmm END</think>"))


def test_a_split_character_before_the_marker_stays_in_its_phase(
    thinking_tokenizer: Tokenizer,
) -> None:
    tok = thinking_tokenizer
    m = tok.reasoning_markers
    assert m is not None
    emoji = _ids(tok, "🙂")
    assert len(emoji) > 1  # byte-level pieces: the character completes with its last one
    splitter = ReasoningSplitter(m, [m.start_id])
    splitter.token(emoji[0], "")
    splitter.token(m.end_id, "🙂</think>")  # the held character arrives with the marker
    splitter.token(7, "ok")
    assert splitter.release("🙂</think>ok") == ReasoningSplit("🙂", "ok")


def test_a_special_marker_skipped_by_the_detokenizer(thinking_tokenizer: Tokenizer) -> None:
    m = thinking_tokenizer.reasoning_markers
    assert m is not None
    splitter = ReasoningSplitter(m, [])
    for token, piece in ((m.start_id, ""), (5, "a"), (m.end_id, ""), (6, "b")):
        splitter.token(token, piece)
    assert splitter.release("a") == ReasoningSplit("a", "")
    assert splitter.release("b") == ReasoningSplit("", "b")
    assert splitter.reasoning_tokens == 3
