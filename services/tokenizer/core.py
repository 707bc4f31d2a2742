"""Turning a GenerateRequest into token ids, synchronously (the service runs it in a thread)."""

from __future__ import annotations

from typing import Any

from shared.messages.common import ErrorInfo
from shared.messages.heartbeat import ModelInfo
from shared.messages.tokenize import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    Prompt,
    TextPrompt,
    TokenPrompt,
)
from shared.model_files import (
    ModelSource,
    eos_token_ids,
    load_tokenizer,
    read_architecture,
    read_context_length,
)

# The native API's names for the fields the tokenizer refuses (the OpenAI names are the keys).
NATIVE_NAMES = {
    "prompt": "text",
    "max_tokens": "sampling_params.max_new_tokens",
    "logit_bias": "sampling_params.logit_bias",
    "stop_token_ids": "sampling_params.stop_token_ids",
}


# /v1/completions takes token ids in `prompt`
OPENAI_NAMES = {"input_ids": "prompt"}
# /v1/responses: the conversation is `input`, the output limit `max_output_tokens`
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}


def field_name(req: GenerateRequest, name: str) -> str:
    """`name` as the request's API spells it."""
    if req.api == "native":
        return NATIVE_NAMES.get(name, name)
    if req.api == "embeddings":  # /v1/embeddings names its prompts, text or ids, `input`
        return "input" if name in ("prompt", "input_ids") else name
    if req.api == "responses":
        return RESPONSES_NAMES.get(name, name)
    return OPENAI_NAMES.get(name, name)


class PromptError(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.info = ErrorInfo(status=400, message=message, param=param)


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (tool calls and ids only where present)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


class Tokenization:
    """The model's tokenizer, chat template and limits."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.tokenizer: Any = load_tokenizer(source)
        self.context_length = read_context_length(source)
        self.eos_token_ids = eos_token_ids(source, self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self._markers: dict[str, int | None] = {}  # think-end text -> its token (None: not one)

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            path=self.source.path,
            name=self.source.name,
            architecture=read_architecture(self.source),
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
        )

    def encode(self, prompt: Prompt, ids_field: str = "input_ids") -> tuple[list[int], str]:
        """The prompt's token ids, and the request field they came from (for errors; token
        ids came in `ids_field`). No length checks: `encode_prompt` adds them for generation."""
        if isinstance(prompt, TextPrompt):
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
            return list(ids), "prompt"
        if isinstance(prompt, TokenPrompt):
            self.check_ids(prompt.input_ids, ids_field)
            return list(prompt.input_ids), "input_ids"
        if isinstance(prompt, ChatPrompt):
            return self.apply_chat_template(prompt), "messages"
        raise PromptError(f"unknown prompt kind {type(prompt).__name__}", "prompt")

    def encode_prompt(self, req: GenerateRequest) -> list[int]:
        ids, param = self.encode(req.prompt, field_name(req, "input_ids"))
        param = field_name(req, param)
        if not ids:
            raise PromptError("the prompt is empty", param)
        if req.embed and len(ids) > self.context_length:  # computed, nothing generated after it
            raise PromptError(
                f"the input is {len(ids)} tokens long; this model's context length is "
                f"{self.context_length} tokens",
                param,
            )
        if len(ids) >= self.context_length and not req.embed:
            raise PromptError(
                f"the prompt is {len(ids)} tokens long; this model's context length is "
                f"{self.context_length} tokens, which must also hold at least one output token",
                param,
            )
        return ids

    def check_ids(self, ids: list[int], param: str) -> None:
        """Every id must name a token of the vocabulary; the error names the first bad one."""
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise PromptError(
                    f"{param}[{i}] is token id {t}, outside the vocabulary [0, {self.vocab_size})",
                    f"{param}[{i}]",
                )

    def decode(self, ids: list[int], skip_special_tokens: bool, param: str) -> str:
        self.check_ids(ids, param)
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, prompt: ChatPrompt) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(
                f"model {self.source.name} has no chat template; use /v1/completions", "messages"
            )
        messages = [message_dict(m) for m in prompt.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                tools=prompt.tools or None,
                **prompt.template_kwargs,
            )
        except Exception as e:  # jinja raises TemplateError, and templates raise their own
            raise PromptError(f"the chat template rejected these messages: {e}", "messages") from e
        # The template already wrote the special tokens (BOS included) as text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_sampling(self, req: GenerateRequest, prompt_len: int) -> None:
        """What only the tokenizer can check: token ids against the vocabulary, positions
        against the prompt."""
        s = req.sampling
        for t in s.logit_bias:
            if not 0 <= t < self.vocab_size:
                name = field_name(req, "logit_bias")
                raise PromptError(
                    f"{name} has token id {t}, outside the vocabulary [0, {self.vocab_size})", name
                )
        for t in s.stop_token_ids:
            if t >= self.vocab_size:
                name = field_name(req, "stop_token_ids")
                raise PromptError(
                    f"{name} has token id {t}, outside the vocabulary [0, {self.vocab_size})", name
                )
        if s.logprob_start_len > prompt_len:  # equal: no prompt token's (SGLang allows it)
            raise PromptError(
                f"logprob_start_len ({s.logprob_start_len}) must be at most the prompt's "
                f"length ({prompt_len} tokens)",
                "logprob_start_len",
            )

    def think_end_id(self, req: GenerateRequest, ids: list[int]) -> int | None:
        """The token after which the request's constraint starts, or None: from the first.

        A gateway with --reasoning-parser sends its end marker (`req.think_end`, "</think>")
        with every constrained chat request. The model will think first unless the rendered
        prompt `ids` already closed the thinking part (Qwen3's enable_thinking false writes an
        empty `<think>\n\n</think>\n\n`): then its last token but whitespace is the marker.
        A marker that is not one token of the vocabulary could not be recognised as it is
        generated: such a request is refused rather than constrained from the start."""
        if not req.think_end or req.constraint is None or not isinstance(req.prompt, ChatPrompt):
            return None
        end = self.marker_id(req.think_end)
        if end is None:
            param = req.constraint.param
            raise PromptError(
                f"{param} cannot start after the model's thinking part: the reasoning parser's "
                f"end marker {req.think_end!r} is not a single token of model "
                f"{self.source.name}'s vocabulary (check --reasoning-parser)",
                param,
            )
        for t in reversed(ids[-16:]):
            if t == end:
                return None  # thinking already closed by the template: constrained at once
            if self.tokenizer.decode([t], skip_special_tokens=False).strip():
                break
        return end

    def marker_id(self, text: str) -> int | None:
        """The one token that spells `text`, or None if it takes several (memoised)."""
        if text not in self._markers:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            one = len(ids) == 1 and self.tokenizer.decode(ids, skip_special_tokens=False) == text
            self._markers[text] = int(ids[0]) if one else None
        return self._markers[text]

    def prompt_text(self, req: GenerateRequest, ids: list[int]) -> str:
        """The prompt as the client sees it echoed: its own text, or its ids decoded."""
        if isinstance(req.prompt, TextPrompt):
            return req.prompt.text
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def max_new_tokens(self, req: GenerateRequest, prompt_len: int) -> int:
        room = self.context_length - prompt_len
        wanted = req.sampling.max_new_tokens
        if wanted is None:
            return room
        if wanted > room:
            name = field_name(req, "max_tokens")
            raise PromptError(
                f"{name}={wanted} plus the prompt's {prompt_len} tokens exceeds this model's "
                f"context length of {self.context_length} tokens (at most {room} allowed)",
                name,
            )
        return wanted
