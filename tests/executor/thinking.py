"""A tiny reasoning model: the tiny tokenizer plus `<think>` and `</think>` as single added
tokens (as in Qwen3's and DeepSeek-R1's vocabularies), and ChatML templates that think.

- OPENS_THINK (DeepSeek-R1, Qwen3 Thinking-2507): the prompt ends with "<think>\\n"; here
  `enable_thinking: false` closes it too, as QWEN3 does.
- QWEN3 (Qwen3's hybrid): the model opens `<think>` itself; `enable_thinking: false` writes an
  empty block "<think>\\n\\n</think>\\n\\n" into the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from tests.executor.helpers import TINY_VOCAB_SIZE, make_hf_model, make_tokenizer

THINK_ID, THINK_END_ID = TINY_VOCAB_SIZE, TINY_VOCAB_SIZE + 1
THINKING_VOCAB_SIZE = TINY_VOCAB_SIZE + 2

_MESSAGES = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
)
_NO_THINKING = "enable_thinking is defined and enable_thinking is false"
_CLOSED = "{{ '<think>\\n\\n</think>\\n\\n' }}"
OPENS_THINK = (
    _MESSAGES + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if " + _NO_THINKING + " %}" + _CLOSED + "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
QWEN3 = (
    _MESSAGES + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if " + _NO_THINKING + " %}" + _CLOSED + "{% endif %}{% endif %}"
)


def make_thinking_tokenizer(template: str = OPENS_THINK) -> PreTrainedTokenizerFast:
    tok = make_tokenizer()
    tok.add_tokens(["<think>", "</think>"])  # not special: decoded text keeps them
    tok.chat_template = template
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK_ID, THINK_END_ID]
    return tok


def write_thinking_model(
    tmp_path: Path, seed: int = 0, template: str = OPENS_THINK, **overrides: Any
) -> Path:
    """A tiny random llama whose vocabulary holds the think tokens, with `template`."""
    path = Path(tmp_path) / f"tiny-thinking-{seed}"
    model = make_hf_model("llama", seed, vocab_size=THINKING_VOCAB_SIZE, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    make_thinking_tokenizer(template).save_pretrained(path)
    return path
