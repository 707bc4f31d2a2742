"""The tiny models' tokenizer loads through AutoTokenizer and round-trips any text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .helpers import BOS_ID, EOS_ID, IM_START_ID, TINY_VOCAB_SIZE, write_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(write_tiny_model(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", ["the theme is in the thin hat", "héllo 世界 🙂", " a\n\tb  "])
def test_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < TINY_VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_vocab_merges_and_special_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == TINY_VOCAB_SIZE
    assert tokenizer.encode("the", add_special_tokens=False) == [ord("t"), 257]
    assert tokenizer.encode(" the", add_special_tokens=False) == [258]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)


def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START_ID and ids.count(EOS_ID) == 1
