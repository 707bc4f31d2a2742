"""Every fixed bound the gateway's validation applies, in one place (the configurable ones,
the body's bytes and the prompt's characters, are flags: see input_limits.py). The OpenAPI
document states them too (openapi_rules.py)."""

from __future__ import annotations

import re

MAX_TOKENS_LIMIT = 1_000_000  # a sanity bound; the tokenizer checks the real context length
MAX_STOP_STRINGS = 16  # stop strings, and stop regexes
MAX_STOP_REGEX_CHARS = 1024
MAX_BATCH = 64  # prompts in one request
MAX_N = 16  # parallel samples of one OpenAI request
MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's and vLLM's bound)
MAX_LOGIT_BIAS = 1024  # entries
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex or grammar; the grammar service checks it
MAX_CHOICES = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
RID_PATTERN = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
SCHEMA_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")  # OpenAI's rule for json_schema.name
