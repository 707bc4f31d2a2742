"""Whether a constrained chat request's grammar waits for the thinking part: the tokenizer
turns the reasoning parser's end tag (GenerateRequest.think_end, sent by a gateway with
--reasoning-parser) into TokenizedRequest.think_end_id when the rendered prompt leaves the
thinking part open, and leaves it None when the template already closed it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.tokenizer.core import Tokenization
from services.tokenizer.handlers import handle
from shared import constants
from shared.messages.common import JsonSchemaConstraint, SamplingParams, Trace
from shared.messages.reply import Failure
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import ChatMessage, ChatPrompt, GenerateRequest, Prompt, TextPrompt
from shared.model_files import resolve_model
from tests.executor.helpers import write_tiny_model
from tests.executor.thinking import OPENS_THINK, QWEN3, THINK_END_ID, write_thinking_model

SCHEMA = JsonSchemaConstraint(schema='{"type": "object"}', param="response_format")
HI = [ChatMessage(role="user", content="hi")]


def load(path: Path) -> Tokenization:
    return Tokenization(resolve_model(str(path)))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Tokenization:
    return load(write_thinking_model(tmp_path_factory.mktemp("qwen3"), template=QWEN3))


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Tokenization:
    return load(write_thinking_model(tmp_path_factory.mktemp("r1"), template=OPENS_THINK))


def request(
    prompt: Prompt, think_end: str = "</think>", constraint: Any = SCHEMA
) -> GenerateRequest:
    return GenerateRequest(
        trace=Trace(rid="t-1", reply_to="rs:reply:g", deadline=1e12),
        prompt=prompt,
        sampling=SamplingParams(max_new_tokens=8),
        constraint=constraint,
        think_end=think_end,
    )


def tokenized(tok: Tokenization, req: GenerateRequest) -> TokenizedRequest:
    (_, _), (stream, out) = handle(tok, req, partitions=1)
    assert isinstance(out, TokenizedRequest)
    expected = constants.SCHEDULE_STREAM if req.constraint is None else constants.GRAMMAR_STREAM
    assert stream == expected
    return out


def test_a_prompt_that_opens_thinking_waits_for_its_end(r1: Tokenization) -> None:
    out = tokenized(r1, request(ChatPrompt(messages=HI)))
    assert r1.tokenizer.decode(out.input_ids).endswith("<|im_start|>assistant\n<think>\n")
    assert out.think_end_id == THINK_END_ID
    assert out.constraint == SCHEMA


def test_qwen3_thinks_unless_enable_thinking_is_false(qwen3: Tokenization) -> None:
    thinking = tokenized(qwen3, request(ChatPrompt(messages=HI)))
    assert qwen3.tokenizer.decode(thinking.input_ids).endswith("<|im_start|>assistant\n")
    assert thinking.think_end_id == THINK_END_ID  # the model opens <think> itself
    off = ChatPrompt(messages=HI, template_kwargs={"enable_thinking": False})
    closed = tokenized(qwen3, request(off))
    assert qwen3.tokenizer.decode(closed.input_ids).endswith("<think>\n\n</think>\n\n")
    assert closed.think_end_id is None  # the template closed it: constrained from the start


def test_no_parser_no_constraint_or_no_chat_means_no_waiting(r1: Tokenization) -> None:
    chat = ChatPrompt(messages=HI)
    assert tokenized(r1, request(chat, think_end="")).think_end_id is None
    assert tokenized(r1, request(chat, constraint=None)).think_end_id is None
    assert tokenized(r1, request(TextPrompt(text="<think>\n"))).think_end_id is None


def test_an_end_tag_that_is_not_one_token_is_a_400(
    r1: Tokenization, tmp_path_factory: pytest.TempPathFactory
) -> None:
    plain = load(write_tiny_model(tmp_path_factory.mktemp("plain")))  # no think tokens
    for tok, tag in ((plain, "</think>"), (r1, "</reasoning>")):
        ((stream, reply),) = handle(tok, request(ChatPrompt(messages=HI), think_end=tag), 1)
        assert stream == "rs:reply:g" and isinstance(reply, Failure)
        assert reply.error.status == 400 and reply.error.param == "response_format"
        assert repr(tag) in reply.error.message and "single token" in reply.error.message
