"""Turning a GenerateRequest into token ids, synchronously (the service runs it in a thread)."""

from __future__ import annotations

from typing import Any

from shared.messages.common import ErrorInfo, SamplingParams
from shared.messages.tokenize import ChatPrompt, GenerateRequest, TextPrompt, TokenPrompt
from shared.model_files import ModelSource, eos_token_ids, load_tokenizer, read_context_length


class PromptError(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.info = ErrorInfo(status=400, message=message, param=param)


class Tokenization:
    """The model's tokenizer, chat template and limits."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.tokenizer: Any = load_tokenizer(source)
        self.context_length = read_context_length(source)
        self.eos_token_ids = eos_token_ids(source, self.tokenizer)
        self.vocab_size = len(self.tokenizer)

    def encode_prompt(self, req: GenerateRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, TextPrompt):
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
            param = "prompt"
        elif isinstance(prompt, TokenPrompt):
            ids, param = list(prompt.input_ids), "input_ids"
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param
                )
        elif isinstance(prompt, ChatPrompt):
            ids, param = self.apply_chat_template(prompt), "messages"
        else:  # pragma: no cover - the tagged union has no other members
            raise PromptError(f"unknown prompt kind {type(prompt).__name__}", "prompt")
        if not ids:
            raise PromptError("the prompt is empty", param)
        if len(ids) >= self.context_length:
            raise PromptError(
                f"the prompt is {len(ids)} tokens long; this model's context length is "
                f"{self.context_length} tokens, which must also hold at least one output token",
                param,
            )
        return list(ids)

    def apply_chat_template(self, prompt: ChatPrompt) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(
                f"model {self.source.name} has no chat template; use /v1/completions", "messages"
            )
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt.add_generation_prompt
            )
        except Exception as e:  # jinja raises TemplateError, and templates raise their own
            raise PromptError(f"the chat template rejected these messages: {e}", "messages") from e
        # The template already wrote the special tokens (BOS included) as text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_sampling(self, s: SamplingParams, prompt_len: int) -> None:
        """What only the tokenizer can check: token ids against the vocabulary, positions
        against the prompt."""
        for t in s.logit_bias:
            if not 0 <= t < self.vocab_size:
                raise PromptError(
                    f"logit_bias has token id {t}, outside the vocabulary [0, {self.vocab_size})",
                    "logit_bias",
                )
        for t in s.stop_token_ids:
            if t >= self.vocab_size:
                raise PromptError(
                    f"stop_token_ids has token id {t}, outside the vocabulary "
                    f"[0, {self.vocab_size})",
                    "stop_token_ids",
                )
        if s.logprob_start_len >= prompt_len:
            raise PromptError(
                f"logprob_start_len ({s.logprob_start_len}) must be less than the prompt's "
                f"length ({prompt_len} tokens)",
                "logprob_start_len",
            )

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
            raise PromptError(
                f"max_tokens={wanted} plus the prompt's {prompt_len} tokens exceeds this model's "
                f"context length of {self.context_length} tokens (at most {room} allowed)",
                "max_tokens",
            )
        return wanted
