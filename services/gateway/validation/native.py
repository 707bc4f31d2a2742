"""SGLang's native `/generate` bodies -> jobs (one per prompt and sample)."""

from __future__ import annotations

import msgspec

from services.gateway.errors import invalid
from services.gateway.protocol import ChatMessageBody, GenerateBody
from services.gateway.validation.chat import chat_prompt
from services.gateway.validation.common import Job, client_rids, nonempty, samples, token_ids
from services.gateway.validation.constraints import native_constraint
from services.gateway.validation.limits import MAX_BATCH, MAX_LOGPROBS, MAX_N
from services.gateway.validation.sampling import check_range, native_sampling
from services.gateway.validation.sglang_fields import refuse_unsupported
from shared.messages.tokenize import Prompt, TextPrompt, TokenPrompt


def native_jobs(body: GenerateBody) -> tuple[list[Job], bool]:
    """The jobs of a /generate body, and whether it was a batch (a list of prompts): one job
    per prompt, each `sampling_params.n` times, prompt-major, as SGLang orders them."""
    check_native_options(body)
    prompts, batched = native_prompts(body)
    return prompt_jobs(prompts, batched, body), batched or body.sampling_params.n > 1


def native_chat_jobs(messages: list[ChatMessageBody], body: GenerateBody) -> list[Job]:
    """The jobs of a conversation (through the chat template) with /generate's other fields
    (`body`'s text and input_ids unused): its `n` samples."""
    check_native_options(body)
    return prompt_jobs([chat_prompt(messages)], False, body)


def check_native_options(body: GenerateBody) -> None:
    s = body.sampling_params
    refuse_unsupported(body)
    refuse_unsupported(s, "sampling_params.")
    if not 1 <= s.n <= MAX_N:
        raise invalid(
            f"sampling_params.n must be between 1 and {MAX_N}, got {s.n}", "sampling_params.n"
        )
    check_range(
        "top_logprobs_num",
        body.top_logprobs_num,
        0 <= body.top_logprobs_num <= MAX_LOGPROBS,
        f"between 0 and {MAX_LOGPROBS}",
    )
    check_range(
        "logprob_start_len",
        body.logprob_start_len,
        body.logprob_start_len >= -1,
        "-1 (no prompt logprobs) or a prompt position >= 0",
    )


def prompt_jobs(prompts: list[Prompt], batched: bool, body: GenerateBody) -> list[Job]:
    """One job per prompt and sample, with `body`'s sampling, logprob options and rids."""
    s = body.sampling_params
    rids = client_rids(body.rid, len(prompts), batched)
    sampling = native_sampling(s)
    if body.return_logprob:
        sampling = msgspec.structs.replace(
            sampling,
            return_logprob=True,
            top_logprobs=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
        )
    constraint = native_constraint(s)
    jobs = []
    for prompt, rid in zip(prompts, rids, strict=True):
        job = Job(
            prompt=prompt,
            sampling=sampling,
            stream=body.stream,
            rid=rid,
            constraint=constraint,
            api="native",
        )
        jobs += samples(job, s.n)
    return jobs


def native_prompts(body: GenerateBody) -> tuple[list[Prompt], bool]:
    """The prompts of /generate, and whether they came as a batch (a list)."""
    if body.text is not None and body.input_ids is not None:
        raise invalid("give either text or input_ids, not both", "input_ids")
    if body.input_ids is not None:
        ids = nonempty(body.input_ids, "input_ids")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return [TokenPrompt(input_ids=token_ids(ids, "input_ids"))], False
        if len(ids) > MAX_BATCH:
            raise invalid(f"input_ids may hold at most {MAX_BATCH} prompts", "input_ids")
        out: list[Prompt] = []
        for i, p in enumerate(ids):
            at = f"input_ids[{i}]"
            if not isinstance(p, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in p
            ):
                raise invalid(f"{at} must be a list of token ids", at)
            out.append(TokenPrompt(input_ids=token_ids(nonempty(p, at), at)))
        return out, True
    if isinstance(body.text, list):
        if len(nonempty(body.text, "text")) > MAX_BATCH:
            raise invalid(f"text may hold at most {MAX_BATCH} prompts", "text")
        return [TextPrompt(text=nonempty(t, f"text[{i}]")) for i, t in enumerate(body.text)], True
    if not body.text:
        raise invalid("text (or input_ids) is required and must not be empty", "text")
    return [TextPrompt(text=body.text)], False
