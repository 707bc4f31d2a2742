"""SMG's SGLang worker protocol (`sglang.grpc.scheduler`, from smg-grpc-proto) <-> the
gateway's bodies and replies. Pure.

A GenerateRequest becomes the /generate body it stands for (token ids in) and is validated by
the same code. What the protocol can ask for and radixserve does not do (images, LoRA, hidden
states, disaggregation, ...) is refused by name rather than ignored. Proto3 cannot tell an
unset number from zero, so zeros take SGLang's meaning as SMG's own servicer reads them:
temperature 0 is greedy, top_p / repetition_penalty 0 are 1, top_k 0 is off, n 0 is 1, and an
absent max_new_tokens is "up to the context length".

Replies: streamed, a chunk per delta (new token ids, cumulative counts, the new logprobs) and
then, per sample, a GenerateComplete whose output_ids are the last delta's (as SGLang's
servicer sends them); not streamed, one GenerateComplete per sample with all its output ids
and logprobs. SMG reads usage only from the GenerateComplete.
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

from services.gateway import validation
from services.gateway.errors import ApiError, invalid
from services.gateway.protocol import GenerateBody
from services.gateway.responses import Accumulated
from services.gateway.validation import Job
from shared.messages.reply import Delta, TokenLogprob


def _refuse_unsupported(req: sgl.GenerateRequest) -> None:
    mm = req.mm_inputs
    if req.HasField("mm_inputs") and (
        mm.image_urls
        or mm.video_urls
        or mm.audio_urls
        or mm.image_data
        or mm.video_data
        or mm.audio_data
        or mm.HasField("pixel_values")
        or mm.model_specific_tensors
    ):
        raise invalid(
            "multimodal inputs are not supported: the served model reads text only", "mm_inputs"
        )
    unsupported = {
        "input_embeds": bool(req.input_embeds),
        "token_ids_logprob": bool(req.token_ids_logprob),
        "return_hidden_states": req.return_hidden_states,
        "custom_logit_processor": bool(req.custom_logit_processor),
        "lora_id": bool(req.lora_id),
        "disaggregated_params": bool(req.disaggregated_params.bootstrap_host),
        "sampling_params.structural_tag": req.sampling_params.HasField("structural_tag"),
        "sampling_params.custom_params": req.sampling_params.HasField("custom_params"),
    }
    for param, given in unsupported.items():
        if given:
            raise invalid(f"{param} is not supported by this worker", param)


def sampling_fields(s: sgl.SamplingParams) -> dict[str, Any]:
    """/generate's sampling_params for SMG's."""
    out: dict[str, Any] = {
        "max_new_tokens": s.max_new_tokens if s.HasField("max_new_tokens") else None,
        "min_new_tokens": s.min_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p or 1.0,
        "top_k": -1 if s.top_k == 0 else s.top_k,
        "min_p": s.min_p,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty or 1.0,
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": s.skip_special_tokens,
        "spaces_between_special_tokens": s.spaces_between_special_tokens,
        "n": s.n or 1,
        "logit_bias": dict(s.logit_bias),
        "no_stop_trim": s.no_stop_trim,
    }
    which = s.WhichOneof("constraint")
    if which == "ebnf_grammar":
        out["ebnf"] = s.ebnf_grammar
    elif which is not None:
        out[which] = getattr(s, which)  # json_schema, regex (structural_tag refused above)
    return out


def generate_jobs(req: sgl.GenerateRequest) -> tuple[GenerateBody, list[Job]]:
    """The request's jobs (its n samples), or an ApiError naming the field as the proto does."""
    _refuse_unsupported(req)
    if not req.tokenized.input_ids:
        raise invalid("tokenized.input_ids must not be empty", "tokenized.input_ids")
    fields: dict[str, Any] = {
        "input_ids": list(req.tokenized.input_ids),
        "sampling_params": sampling_fields(req.sampling_params),
        "stream": req.stream,
        "return_logprob": req.return_logprob,
        "top_logprobs_num": req.top_logprobs_num,
        "logprob_start_len": req.logprob_start_len if req.return_logprob else -1,
    }
    if req.request_id:
        fields["rid"] = req.request_id
    try:
        body = validation.convert(fields, GenerateBody)
        jobs, _ = validation.native_jobs(body)
    except ApiError as e:
        raise _renamed(e) from None
    return body, jobs


def _renamed(e: ApiError) -> ApiError:
    """/generate's names for the fields that SMG's proto names otherwise."""
    names = {"input_ids": "tokenized.input_ids", "rid": "request_id"}
    for ours, theirs in names.items():
        if e.param is not None and (e.param == ours or e.param.startswith(ours + "[")):
            param = theirs + e.param[len(ours) :]
            return ApiError(
                e.status, e.message.replace(e.param, param), param, e.type, e.retry_after
            )
    return e


# -- replies ----------------------------------------------------------------------------------
def _tops(entries: list[TokenLogprob]) -> list[sgl.TopLogProbs]:
    return [
        sgl.TopLogProbs(values=[t.logprob for t in e.top], token_ids=[t.token_id for t in e.top])
        for e in entries
    ]


def output_logprobs(entries: list[TokenLogprob]) -> sgl.OutputLogProbs:
    return sgl.OutputLogProbs(
        token_logprobs=[e.logprob or 0.0 for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=_tops(entries),
    )


def input_logprobs(entries: list[TokenLogprob]) -> sgl.InputLogProbs:
    return sgl.InputLogProbs(
        token_logprobs=[sgl.InputTokenLogProb(value=e.logprob) for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=_tops(entries),
    )


def chunk(rid: str, index: int, d: Delta, acc: Accumulated, logprobs: bool) -> sgl.GenerateResponse:
    u = acc.usage
    c = sgl.GenerateStreamChunk(
        token_ids=d.token_ids,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
        index=index,
    )
    if logprobs:
        c.output_logprobs.CopyFrom(output_logprobs(d.logprobs))
        if d.prompt_logprobs:
            c.input_logprobs.CopyFrom(input_logprobs(d.prompt_logprobs))
    return sgl.GenerateResponse(request_id=rid, chunk=c)


def complete(
    rid: str, index: int, acc: Accumulated, logprobs: bool, output_ids: list[int]
) -> sgl.GenerateResponse:
    """The sample's end: `output_ids` all of them (not streamed) or the last delta's."""
    u = acc.usage
    c = sgl.GenerateComplete(
        output_ids=output_ids,
        finish_reason=acc.finish_reason or "",
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
        index=index,
    )
    if isinstance(acc.matched_stop, str):
        c.matched_stop_str = acc.matched_stop
    elif isinstance(acc.matched_stop, int):
        c.matched_token_id = acc.matched_stop
    if logprobs:
        c.output_logprobs.CopyFrom(output_logprobs(acc.logprobs))
        if acc.prompt_logprobs:
            c.input_logprobs.CopyFrom(input_logprobs(acc.prompt_logprobs))
    return sgl.GenerateResponse(request_id=rid, complete=c)
