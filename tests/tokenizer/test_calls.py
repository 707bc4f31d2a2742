"""The tokenizer's answers to tokenize / detokenize calls, and the model it describes in its
heartbeat."""

from __future__ import annotations

import msgspec
import pytest

from services.tokenizer.core import Tokenization
from services.tokenizer.handlers import handle
from shared.messages.common import HopTimes, SamplingParams, Trace
from shared.messages.detok import DetokRegister
from shared.messages.reply import DetokenizeResult, Failure, TokenizeResult
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import (
    AbortRequest,
    ChatMessage,
    ChatPrompt,
    DetokenizeRequest,
    GenerateRequest,
    TextPrompt,
    TokenizeRequest,
)
from shared.model_files import resolve_model
from tests.executor.helpers import EOS_ID, write_tiny_model

TRACE = Trace(rid="call-1", reply_to="rs:reply:g", deadline=1e12)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenization:
    path = write_tiny_model(tmp_path_factory.mktemp("tok"), max_position_embeddings=64)
    return Tokenization(resolve_model(str(path)))


def test_tokenize_text_answers_the_tokenizers_ids_without_a_length_check(
    tok: Tokenization,
) -> None:
    text = "the thin thing " * 10  # longer than the 64-token context: /tokenize still answers
    for special in (True, False):
        call = TokenizeRequest(
            trace=TRACE, prompt=TextPrompt(text=text, add_special_tokens=special)
        )
        ((stream, reply),) = handle(tok, call, partitions=1)
        expected = tok.tokenizer.encode(text, add_special_tokens=special)
        assert len(expected) > 64
        assert stream == "rs:reply:g"
        assert reply == TokenizeResult(rid="call-1", token_ids=expected, max_model_len=64)


def test_tokenize_chat_applies_the_template(tok: Tokenization) -> None:
    messages = [ChatMessage(role="user", content="hi")]
    for generation_prompt in (True, False):
        prompt = ChatPrompt(messages=messages, add_generation_prompt=generation_prompt)
        ((_, reply),) = handle(tok, TokenizeRequest(trace=TRACE, prompt=prompt), 1)
        assert isinstance(reply, TokenizeResult)
        text = tok.tokenizer.decode(reply.token_ids)
        assert text == "<|im_start|>user\nhi<|im_end|>\n" + (
            "<|im_start|>assistant\n" if generation_prompt else ""
        )


def test_detokenize_round_trips_and_skips_special_tokens_when_asked(tok: Tokenization) -> None:
    ids = [*tok.tokenizer.encode("héllo 世界", add_special_tokens=False), EOS_ID]
    for skip, text in ((False, "héllo 世界<|im_end|>"), (True, "héllo 世界")):
        call = DetokenizeRequest(trace=TRACE, token_ids=ids, skip_special_tokens=skip)
        assert handle(tok, call, 1) == [("rs:reply:g", DetokenizeResult(rid="call-1", text=text))]


def test_detokenize_names_the_first_id_outside_the_vocabulary(tok: Tokenization) -> None:
    call = DetokenizeRequest(trace=TRACE, token_ids=[5, tok.vocab_size, 7])
    ((_, reply),) = handle(tok, call, 1)
    assert isinstance(reply, Failure)
    assert reply.error.status == 400 and reply.error.param == "tokens[1]"
    assert f"outside the vocabulary [0, {tok.vocab_size})" in reply.error.message


def test_expired_calls_get_a_504_and_aborts_are_left_to_the_scheduler(tok: Tokenization) -> None:
    late = Trace(rid="call-2", reply_to="rs:reply:g", deadline=1.0)
    ((_, reply),) = handle(tok, DetokenizeRequest(trace=late, token_ids=[1]), 1)
    assert isinstance(reply, Failure) and reply.error.status == 504
    assert handle(tok, AbortRequest(rid="x"), 1) == []


def test_model_info_describes_the_checkpoint(tok: Tokenization) -> None:
    info = tok.model_info()
    assert info.path == tok.source.path and info.name == tok.source.name
    assert info.architecture == "LlamaForCausalLM"
    assert info.context_length == 64 and info.vocab_size == len(tok.tokenizer)
    assert info.eos_token_ids == [EOS_ID] and info.has_chat_template is True


def test_a_generation_leaves_with_its_tokenized_stamp(tok: Tokenization) -> None:
    hops = HopTimes(gateway_received=1.0)
    req = GenerateRequest(
        trace=msgspec.structs.replace(TRACE, hops=hops),
        prompt=TextPrompt(text="the thin thing"),
        sampling=SamplingParams(max_new_tokens=4),
    )
    (_, register), (_, tokenized) = handle(tok, req, partitions=1)
    assert isinstance(register, DetokRegister) and isinstance(tokenized, TokenizedRequest)
    assert register.trace == tokenized.trace
    stamped = tokenized.trace.hops
    assert stamped is not None and stamped.tokenized > 1.0
    assert msgspec.structs.replace(stamped, tokenized=0.0) == hops
