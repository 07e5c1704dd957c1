"""A tiny "thinking" Llama whose greedy output is fixed by hand: a bigram model.

The shared test tokenizer gains `<think>` / `</think>` as added tokens and a Qwen3-like chat
template (`enable_thinking: false` closes an empty reasoning in the prompt; `think_in_prompt`
opens it there, as DeepSeek-R1's template does). The weights make each position's logits a
function of its own token only (attention and MLP outputs are zeroed, so the residual stream
is the token's embedding), and the LM head maps each chain token to its successor:

    "\\n" -> <think> -> "So" -> " ok" -> </think> -> "Hello" -> " world" -> <|im_end|>
    "\\n\\n" (the prompt's end without thinking) -> "Hi" -> <|im_end|>
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.reasoning_content is defined %}"
    "{{ '<think>' + message.reasoning_content + '</think>' }}{%- endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if think_in_prompt is defined and think_in_prompt %}{{ '<think>' }}{%- endif %}"
    "{%- endif %}"
)
REASONING = "So ok"
CONTENT = "Hello world"
NO_THINKING = "Hi"
# Generated tokens from <think> to </think>, both included.
REASONING_TOKENS = 4


@dataclass(frozen=True)
class Chain:
    """Token ids of the hand-set greedy chain."""

    newline: int
    blank_line: int
    think: int
    end_think: int
    eos: int
    words: dict[str, int]

    def successors(self) -> dict[int, int]:
        w = self.words
        return {
            self.newline: self.think, self.think: w["So"], w["So"]: w[" ok"],
            w[" ok"]: self.end_think, self.end_think: w["Hello"], w["Hello"]: w[" world"],
            w[" world"]: self.eos, self.blank_line: w["Hi"], w["Hi"]: self.eos,
        }


def _single(tok: AutoTokenizer, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is not one token: {ids}"
    return ids[0]


def write_thinking_model(folder: Path, tokenizer_dir: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    tok.chat_template = TEMPLATE
    chain = Chain(
        newline=_single(tok, "\n"), blank_line=_single(tok, "\n\n"),
        think=tok.convert_tokens_to_ids("<think>"),
        end_think=tok.convert_tokens_to_ids("</think>"), eos=tok.eos_token_id,
        words={w: _single(tok, w) for w in ("So", " ok", "Hello", " world", "Hi")},
    )
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for token, successor in chain.successors().items():
            head[successor] += 4.0 * embed[token] / embed[token].norm()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
