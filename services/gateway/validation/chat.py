"""OpenAI `/v1/chat/completions` bodies -> a job (and the messages of /tokenize)."""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.errors import invalid
from services.gateway.protocol import ChatBody, ChatMessageBody
from services.gateway.validation.common import Job, check_model, client_rids
from services.gateway.validation.constraints import openai_constraint
from services.gateway.validation.limits import CHAT_ROLES, MAX_LOGPROBS
from services.gateway.validation.sampling import check_openai_common, check_range, openai_sampling
from services.gateway.validation.sglang_fields import refuse_unsupported
from services.gateway.validation.tools import message_tool_calls, tool_constraint, tool_plan
from shared.messages.tokenize import ChatMessage, ChatPrompt


def chat_job(body: ChatBody, served_model: str, tool_parser: str = "") -> Job:
    """The chat request's job; `tool_parser`: the server's --tool-call-parser ("": none)."""
    check_model(body.model, served_model)
    check_openai_common(body)
    refuse_unsupported(body)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_parser)
    if body.top_logprobs is not None:
        check_range(
            "top_logprobs",
            body.top_logprobs,
            0 <= body.top_logprobs <= MAX_LOGPROBS,
            f"between 0 and {MAX_LOGPROBS}",
        )
        if not body.logprobs:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    max_tokens, max_name = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        max_tokens, max_name = body.max_completion_tokens, "max_completion_tokens"
    sampling = openai_sampling(body, max_tokens, max_name)
    if body.logprobs:
        sampling = msgspec.structs.replace(
            sampling, return_logprob=True, top_logprobs=body.top_logprobs or 0
        )
    constraint = openai_constraint(body)
    calls = tool_constraint(plan)
    if calls is not None:
        if constraint is not None:
            param = constraint.param.split(".")[0]
            raise invalid(
                f"{param} cannot be combined with tool_choice {body.tool_choice!r}: "
                "the calls' arguments are already constrained to the tools' schemas",
                param,
            )
        constraint = calls
    (rid,) = client_rids(body.rid, 1, False)
    return Job(
        prompt=msgspec.structs.replace(
            chat_prompt(body.messages),
            template_kwargs=template_kwargs(body),
            tools=plan.tools if plan is not None else [],
            **generation_prompt(body),
        ),
        sampling=sampling,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        rid=rid,
        constraint=constraint,
        tools=plan,
    )


def generation_prompt(body: ChatBody) -> dict[str, bool]:
    """How the template ends the prompt: a new assistant turn (its generation prompt, unless
    add_generation_prompt is false), or, with continue_final_message, inside the last message,
    which must then be the assistant's."""
    if not body.continue_final_message:
        return {"add_generation_prompt": body.add_generation_prompt}
    last = body.messages[-1] if body.messages else None
    if last is None or last.role != "assistant":
        raise invalid(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    return {"add_generation_prompt": False, "continue_final_message": True}


# Names apply_chat_template itself takes, or the template's own inputs: not a client's to set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def template_kwargs(body: ChatBody) -> dict[str, Any]:
    """chat_template_kwargs (and reasoning_effort, which templates read by that name)."""
    kwargs = dict(body.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise invalid(
                f"chat_template_kwargs may not set {key!r}: it is not a template variable a "
                "request may set",
                f"chat_template_kwargs.{key}",
            )
    if body.reasoning_effort is not None:
        if body.reasoning_effort not in REASONING_EFFORTS:
            raise invalid(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
                f"{body.reasoning_effort!r}",
                "reasoning_effort",
            )
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def chat_prompt(messages: list[ChatMessageBody]) -> ChatPrompt:
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise invalid(
                f"{at}.role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}", f"{at}.role"
            )
        if m.tool_calls and m.role != "assistant":
            raise invalid(f"{at}.tool_calls belong to assistant messages", f"{at}.tool_calls")
        if m.content is None and m.role != "assistant":
            raise invalid(f"{at}.content is required for role {m.role!r}", f"{at}.content")
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
        out.append(
            ChatMessage(
                role=role,
                content=message_text(m.content, f"{at}.content"),
                tool_calls=message_tool_calls(m.tool_calls or [], at),
                tool_call_id=m.tool_call_id or "",
                name=m.name or "",
            )
        )
    return ChatPrompt(messages=out)


def message_text(content: str | list[dict[str, Any]] | None, at: str) -> str:
    """A message's text: the string itself, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise invalid(
                f"{at}[{j}].type must be 'text' (got {kind!r}): only text content is supported",
                f"{at}[{j}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{at}[{j}].text must be a string", f"{at}[{j}].text")
        texts.append(text)
    return "\n".join(texts)
