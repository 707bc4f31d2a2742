"""Tokenization, chat templates and the context-length checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tokenizer.core import Tokenization
from services.tokenizer.handlers import handle
from shared.messages.common import RegexConstraint, SamplingParams, Trace
from shared.messages.detok import DetokRegister
from shared.messages.reply import Failure
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    Prompt,
    TextPrompt,
    TokenPrompt,
)
from shared.model_files import resolve_model
from tests.executor.helpers import EOS_ID, write_tiny_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenization:
    path = write_tiny_model(tmp_path_factory.mktemp("tok"), max_position_embeddings=64)
    return Tokenization(resolve_model(str(path)))


def request(
    prompt: Prompt, max_new: int | None = 4, deadline: float = 1e12, api: str = "openai"
) -> GenerateRequest:
    return GenerateRequest(
        trace=Trace(rid="r", reply_to="rs:reply:g", deadline=deadline),
        prompt=prompt,
        sampling=SamplingParams(max_new_tokens=max_new),
        api=api,
    )


def test_text_prompt_is_registered_then_scheduled(tok: Tokenization) -> None:
    out = handle(tok, request(TextPrompt(text="the thin")), partitions=1)
    assert [s for s, _ in out] == ["rs:detok:0", "rs:schedule"]
    reg, sched = out[0][1], out[1][1]
    assert isinstance(reg, DetokRegister) and isinstance(sched, TokenizedRequest)
    assert tok.tokenizer.decode(sched.input_ids) == "the thin"
    assert reg.prompt_tokens == len(sched.input_ids)
    assert sched.eos_token_ids == [EOS_ID] and sched.max_new_tokens == 4


def test_constrained_request_goes_through_the_grammar_service(tok: Tokenization) -> None:
    req = GenerateRequest(
        trace=Trace(rid="r", reply_to="rs:reply:g", deadline=1e12),
        prompt=TextPrompt(text="the"),
        sampling=SamplingParams(max_new_tokens=4),
        constraint=RegexConstraint(pattern="a+"),
    )
    out = handle(tok, req, partitions=1)
    assert [s for s, _ in out] == ["rs:detok:0", "rs:grammar"]
    sched = out[1][1]
    assert isinstance(sched, TokenizedRequest)
    assert sched.constraint == RegexConstraint(pattern="a+") and sched.grammar_key == ""


def test_chat_template_applied(tok: Tokenization) -> None:
    prompt = ChatPrompt(messages=[ChatMessage(role="user", content="hi")])
    sched = handle(tok, request(prompt), 1)[1][1]
    assert isinstance(sched, TokenizedRequest)
    text = tok.tokenizer.decode(sched.input_ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_continue_final_message_leaves_the_last_message_open(tok: Tokenization) -> None:
    messages = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content="Hello, I am"),
    ]
    prompt = ChatPrompt(messages=messages, add_generation_prompt=False, continue_final_message=True)
    sched = handle(tok, request(prompt), 1)[1][1]
    assert isinstance(sched, TokenizedRequest)
    text = tok.tokenizer.decode(sched.input_ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello, I am"


def test_default_max_tokens_fills_the_context(tok: Tokenization) -> None:
    sched = handle(tok, request(TokenPrompt(input_ids=[1, 2, 3]), max_new=None), 1)[1][1]
    assert isinstance(sched, TokenizedRequest) and sched.max_new_tokens == 64 - 3


LONG_CHAT = ChatPrompt(messages=[ChatMessage(role="user", content="x" * 80)])


@pytest.mark.parametrize(
    ("prompt", "max_new", "api", "param", "words"),
    [
        (TextPrompt(text="x" * 80), 4, "openai", "prompt", "context length"),
        (TokenPrompt(input_ids=list(range(10))), 60, "openai", "max_tokens", "exceeds"),
        # /v1/completions takes token ids in `prompt`, /generate in `input_ids`
        (TokenPrompt(input_ids=[5, 9999]), 4, "openai", "prompt[1]", "outside the vocabulary"),
        (TokenPrompt(input_ids=[5, 9999]), 4, "native", "input_ids[1]", "outside the vocab"),
        (TokenPrompt(input_ids=[5, 9999]), 4, "embeddings", "input[1]", "outside the vocab"),
        (TextPrompt(text=""), 4, "openai", "prompt", "empty"),
        (LONG_CHAT, 4, "openai", "messages", "context length"),
        # /v1/responses: the conversation came as `input`, the limit as `max_output_tokens`
        (LONG_CHAT, 4, "responses", "input", "context length"),
        (TokenPrompt(input_ids=list(range(10))), 60, "responses", "max_output_tokens", "exceeds"),
    ],
)
def test_bad_prompts_get_a_400_naming_the_field(
    tok: Tokenization, prompt: Prompt, max_new: int, api: str, param: str, words: str
) -> None:
    out = handle(tok, request(prompt, max_new, api=api), 1)
    assert len(out) == 1
    stream, msg = out[0]
    assert stream == "rs:reply:g" and isinstance(msg, Failure)
    assert msg.error.status == 400 and msg.error.param == param
    assert words in msg.error.message


def test_expired_request_is_refused(tok: Tokenization) -> None:
    ((_, msg),) = handle(tok, request(TextPrompt(text="a"), deadline=1.0), 1)
    assert isinstance(msg, Failure) and msg.error.status == 504


def test_partitions_spread_requests(tok: Tokenization) -> None:
    streams = set()
    for i in range(40):
        req = GenerateRequest(
            trace=Trace(rid=f"rid-{i}", reply_to="g", deadline=1e12),
            prompt=TextPrompt(text="a"),
            sampling=SamplingParams(max_new_tokens=1),
        )
        streams.add(handle(tok, req, partitions=4)[0][0])
    assert streams == {f"rs:detok:{p}" for p in range(4)}


def test_model_path_errors_name_the_path(tmp_path: Path) -> None:
    from shared.model_files import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="no config\\.json"):
        resolve_model(str(tmp_path))


# Qwen3's way: thinking off writes an empty thinking block into the prompt.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% if reasoning_effort %}effort: {{ reasoning_effort }}\n{% endif %}{% endif %}"
)


def test_template_kwargs_reach_the_chat_template(tok: Tokenization) -> None:
    messages = [ChatMessage(role="user", content="hi")]
    saved = tok.tokenizer.chat_template
    tok.tokenizer.chat_template = THINKING_TEMPLATE
    try:

        def rendered(**kwargs: object) -> str:
            prompt = ChatPrompt(messages=messages, template_kwargs=kwargs)
            sched = handle(tok, request(prompt, max_new=1), 1)[1][1]
            assert isinstance(sched, TokenizedRequest)
            return str(tok.tokenizer.decode(sched.input_ids))

        thinking = rendered()
        assert thinking.endswith("<|im_start|>assistant\n")
        assert rendered(enable_thinking=False) == thinking + "<think>\n\n</think>\n\n"
        assert rendered(reasoning_effort="low") == thinking + "effort: low\n"
    finally:
        tok.tokenizer.chat_template = saved


# A template in the common shape (Qwen2.5's, much shortened): tools in the system turn, an
# assistant's calls and the tool's answer in their own turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_and_calls_reach_the_chat_template(tok: Tokenization) -> None:
    tool = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"x": 1}}}
    messages = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content="", tool_calls=[call]),
        ChatMessage(role="tool", content="ok", tool_call_id="c1"),
    ]
    saved = tok.tokenizer.chat_template
    tok.tokenizer.chat_template = TOOLS_TEMPLATE
    try:
        # (rendered without the length check: the tiny model's context is 64 tokens)
        ids = tok.apply_chat_template(ChatPrompt(messages=messages, tools=[tool]))
        text = tok.tokenizer.decode(ids)
    finally:
        tok.tokenizer.chat_template = saved
    assert '"name": "w"' in text.split("<|im_end|>")[0]  # the tool, in the system turn
    assert '<tool_call>{"name": "w", "arguments": {"x": 1}}</tool_call>' in text
    assert "<|im_start|>tool\nok [c1]<|im_end|>" in text
