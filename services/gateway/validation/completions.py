"""OpenAI `/v1/completions` bodies -> jobs."""

from __future__ import annotations

import msgspec

from services.gateway.errors import invalid
from services.gateway.protocol import CompletionBody
from services.gateway.validation.common import Job, check_model, client_rids, nonempty, token_ids
from services.gateway.validation.constraints import openai_constraint
from services.gateway.validation.limits import MAX_BATCH, MAX_LOGPROBS, MAX_N
from services.gateway.validation.sampling import check_openai_common, check_range, openai_sampling
from services.gateway.validation.sglang_fields import refuse_unsupported
from shared.messages.tokenize import Prompt, TextPrompt, TokenPrompt


def completion_jobs(body: CompletionBody, served_model: str) -> list[Job]:
    """One job per prompt (a list of prompts is a batch); `n` / `best_of` fan out later."""
    check_model(body.model, served_model)
    check_openai_common(body)
    refuse_unsupported(body)
    if body.suffix:
        raise invalid(
            "suffix is not supported: this server has no fill-in-the-middle mode", "suffix"
        )
    check_range(
        "logprobs",
        body.logprobs or 0,
        0 <= (body.logprobs or 0) <= MAX_LOGPROBS,
        f"between 0 and {MAX_LOGPROBS}",
    )
    best_of_count(body)
    sampling = openai_sampling(body, body.max_tokens, "max_tokens")
    if body.logprobs is not None:
        sampling = msgspec.structs.replace(
            sampling,
            return_logprob=True,
            top_logprobs=body.logprobs,
            # echo with logprobs covers the prompt too, as OpenAI's API does
            logprob_start_len=0 if body.echo else -1,
        )
    prompts = completion_prompts(body.prompt)
    # a list of prompts is a batch, whose rid is a list with one per prompt
    batched = isinstance(body.prompt, list) and not all(isinstance(x, int) for x in body.prompt)
    rids = client_rids(body.rid, len(prompts), batched)
    constraint = openai_constraint(body)
    return [
        Job(
            prompt=p,
            sampling=sampling,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            rid=rid,
            constraint=constraint,
            echo=body.echo,
        )
        for p, rid in zip(prompts, rids, strict=True)
    ]


def best_of_count(body: CompletionBody) -> int:
    """How many samples to generate per prompt: `best_of`, of which the `n` with the highest
    cumulative logprob are returned (OpenAI's rule: best_of >= n, and no streaming)."""
    n = body.n or 1
    if body.best_of is None:
        return n
    if not n <= body.best_of <= MAX_N:
        raise invalid(f"best_of must be between n ({n}) and {MAX_N}, got {body.best_of}", "best_of")
    if body.stream and body.best_of > n:
        raise invalid("best_of > n cannot be streamed: set stream to false", "best_of")
    return body.best_of


def completion_prompts(
    prompt: str | list[str | int | list[int]], field: str = "prompt"
) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists
    (`field`: the body's name for them, which refusals use)."""
    if isinstance(prompt, str):
        return [TextPrompt(text=nonempty(prompt, field))]
    if not prompt:
        raise invalid(f"{field} must not be empty", field)
    if all(isinstance(x, int) for x in prompt):
        return [TokenPrompt(input_ids=token_ids(prompt, field))]
    if len(prompt) > MAX_BATCH:
        raise invalid(f"{field} may hold at most {MAX_BATCH} prompts", field)
    out: list[Prompt] = []
    for i, p in enumerate(prompt):
        at = f"{field}[{i}]"
        if isinstance(p, str):
            out.append(TextPrompt(text=nonempty(p, at)))
        elif isinstance(p, list):
            out.append(TokenPrompt(input_ids=token_ids(nonempty(p, at), at)))
        else:
            raise invalid(
                f"{at} must be a string or a list of token ids (the list mixes "
                "token ids with prompts)",
                at,
            )
    return out
