"""Request bodies -> validated `Job`s (prompt + SamplingParams). Pure: no I/O, no awaits.

The gateway checks types and ranges; the tokenizer checks lengths against the context. Every
refusal is a 400 whose `param` names the field as the client spelled it. One module a concern:

- completions.py, chat.py, native.py: each API dialect's bodies;
- sampling.py: the sampling controls they share; constraints.py: structured output;
- common.py: the Job, body decoding, ids, `n` samples; limits.py: every fixed bound.

The names below are what the handlers use.
"""

from services.gateway.validation.chat import chat_job, chat_prompt, message_text
from services.gateway.validation.common import (
    Job,
    check_model,
    check_rid,
    client_rids,
    convert,
    decode,
    samples,
    token_ids,
    unsupported,
)
from services.gateway.validation.completions import (
    best_of_count,
    completion_jobs,
    completion_prompts,
)
from services.gateway.validation.constraints import (
    native_constraint,
    openai_constraint,
    response_format_constraint,
)
from services.gateway.validation.native import (
    native_chat_jobs,
    native_jobs,
    native_prompts,
)
from services.gateway.validation.sampling import logit_biases, sampling_params, stop_strings

__all__ = [
    "Job",
    "best_of_count",
    "chat_job",
    "chat_prompt",
    "check_model",
    "check_rid",
    "client_rids",
    "completion_jobs",
    "completion_prompts",
    "convert",
    "decode",
    "logit_biases",
    "message_text",
    "native_chat_jobs",
    "native_constraint",
    "native_jobs",
    "native_prompts",
    "openai_constraint",
    "response_format_constraint",
    "samples",
    "sampling_params",
    "stop_strings",
    "token_ids",
    "unsupported",
]
