"""Request bodies of each endpoint, decoded with `msgspec.json.decode(body, type=...)`.

Unknown fields are refused (`forbid_unknown_fields`): a parameter the engine would silently
ignore misleads the client. Parameters that are known but not supported yet are declared here
so validation.py can refuse them by name ("presence_penalty is not supported yet").
Ranges are checked in validation.py, not here, so the messages can say what is allowed.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct, kw_only=True):
    """Unknown options are ignored on purpose: none of them changes the generated text."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class JsonSchemaSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`response_format.json_schema`: OpenAI's structured-output schema."""

    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # accepted; the schema is always enforced


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(
    msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True
):
    pass


class JsonSchemaFormat(
    msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True, forbid_unknown_fields=True
):
    json_schema: JsonSchemaSpec


# `response_format` by its "type"; an unknown type is a 400 naming response_format.type.
ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class SGLangFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Request fields of SGLang's APIs that radixserve does not act on. SGLang's own clients
    send some of them at their "off" value on every request (bench_serving's
    `"lora_path": null`), so each is accepted at that value (None, false, or a list of them)
    and refused by name otherwise (validation/sglang_fields.py), never silently ignored."""

    lora_path: Any = None
    return_hidden_states: Any = False
    session_params: Any = None
    custom_logit_processor: Any = None
    custom_params: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    extra_key: Any = None
    cache_salt: Any = None  # vLLM's and SGLang's per-tenant prefix-cache salt
    priority: Any = None
    custom_labels: Any = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (since its v0.12; the guided_* fields before): at most one
    of json, regex, choice, grammar (EBNF) and json_object. The rest is refused when it asks
    for something (validation/sglang_fields.py), but disable_fallback: there is one backend."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: Any = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class _OpenAIParams(SGLangFields, kw_only=True):
    """Parameters common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # extensions that vLLM and SGLang accept too (the openai client sends them via extra_body)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # structured output (chat in OpenAI's API; completions too, as vLLM accepts it), or
    # SGLang's own fields for it: at most one of them
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    # SGLang's: the output ends right after a match of one of these (kept in the output)
    stop_regex: str | list[str] | None = None
    # SGLang's: keep the matched stop string (or stop token's text) in the output
    no_stop_trim: bool = False
    # SGLang's: the request's id (its samples rid-1, rid-2, ...), for /abort_request
    rid: str | list[str] | None = None
    # vLLM's structured output, the current field and the older ones (removed in its v0.12,
    # still in clients' code), and its name for no_stop_trim
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused when given
    guided_decoding_backend: str | None = None  # accepted and not used: there is one backend
    include_stop_str_in_output: bool = False


class CompletionBody(_OpenAIParams, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or
    a list of token-id lists; each prompt of a batch gets `n` choices."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    json_schema: str | dict[str, Any] | None = None  # SGLang's: JSON text or the schema


class ChatMessageBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    # a string, or parts like {"type": "text", "text": "..."}; checked in validation.py
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatBody(_OpenAIParams, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # reasoning models: extra variables for the chat template (Qwen3's enable_thinking), the
    # effort the template is told of, and SGLang's switch for --reasoning-parser's split
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    separate_reasoning: bool = True
    # SGLang's: false holds the thinking part back and sends it whole once it ends
    stream_reasoning: bool = True
    # vLLM's and SGLang's: the output continues the last (assistant) message instead of
    # starting a new one; the template then writes no generation prompt
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # OpenAI's fields that change nothing a client receives here: accepted and not used
    # (nothing is stored; the prefix cache needs no key; there is one service tier)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: Any = None  # predicted output: a latency hint, the output is the same
    modalities: list[str] | None = None  # ["text"] only (checked in validation)
    # ... and those refused when set (validation/sglang_fields.py)
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class NativeSamplingBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`sampling_params` of POST /generate (SGLang's names and defaults)."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # the output ends after a match (kept)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    # structured output, at most one of them
    json_schema: str | dict[str, Any] | None = None  # JSON text or the schema object itself
    regex: str | None = None
    ebnf: str | None = None
    choices: list[str] | None = None
    structural_tag: Any = None  # refused when given (validation/sglang_fields.py)
    no_stop_trim: bool = False  # keep the matched stop string (or stop token's text)
    sampling_seed: int | None = None  # SGLang's name for seed (seed wins when both are given)
    custom_params: Any = None  # refused when given
    # how often SGLang streams (every N tokens); radixserve streams each step's tokens as
    # they come, which only changes how the same text is cut into chunks
    stream_interval: int | None = None


class GenerateBody(SGLangFields, kw_only=True):
    """POST /generate: exactly one of `text` (a string, or a list of them for a batch) and
    `input_ids` (a list of ids, or a list of such lists); checked in validation.py."""

    # routers (SMG) add the model's name; /generate serves the one model and, as SGLang's,
    # does not read it (SMG sends "unknown" where it has no name)
    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: NativeSamplingBody = msgspec.field(default_factory=NativeSamplingBody)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: prompt logprobs from this position on
    return_text_in_logprobs: bool = False
    # meta_info.hop_latency_ms on the last object: where the first token's time went, in ms
    # per stage (see services/gateway/hop_stats.py)
    return_hop_latency: bool = False
    # SGLang's other /generate fields: refused by name when set (validation/sglang_fields.py)
    lora_id: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    modalities: Any = None
    token_ids_logprob: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: Any = None
    background: Any = False
    return_bytes: Any = False
    return_entropy: Any = False
    # ... and those that change nothing a client receives: accepted and not used
    log_metrics: bool = True
    no_logs: bool = False
    validation_time: float | None = None
    conversation_id: str | None = None


class TokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /tokenize: exactly one of `text` (`prompt` is vLLM's name for it) and `messages`
    (tokenized through the model's chat template, which writes its own special tokens, so
    `add_special_tokens` applies to text only)."""

    model: str | None = None
    text: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessageBody] | None = None
    add_generation_prompt: bool = True


class DetokenizeBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


class AbortBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /abort_request: one `rid` (any gateway's), or `abort_all` of this gateway's."""

    rid: str | None = None
    abort_all: bool = False
