"""`radixserve.Engine`: the whole engine in the caller's process, no Redis and no HTTP.

    from radixserve import Engine

    with Engine(model="path/to/model", max_total_tokens=8192) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"])

Requests are validated by the HTTP API's own rules (a bad one raises ValueError naming the
field, with the message a 400 would carry), tokenized by the tokenizer service's core, run by
the executor's engine on a thread of its own, and detokenized by the detokenizer's core; the
results have /generate's shape (SGLang's): `text`, `output_ids`, `meta_info`.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import numpy as np
import torch

from radixserve.engine.flags import engine_args, engine_argv
from radixserve.engine.pipeline import Pipeline, Reply, RequestError, Sink
from services.executor.builder import build_engine, settings_from_flags
from services.executor.distributed.node import ExecutorGroup
from services.executor.grammar.backend import GrammarBackend
from services.gateway import validation
from services.gateway.embeddings_api import EmbeddingBody, embedding_jobs
from services.gateway.errors import ApiError
from services.gateway.native_api import NativeRenderer
from services.gateway.protocol import ChatMessageBody, GenerateBody
from services.tokenizer.core import Tokenization
from shared.grammar import GrammarTokenizer
from shared.messages.common import ErrorInfo
from shared.messages.reply import Failure, Usage
from shared.model_files import read_architecture, resolve_model

Result = dict[str, Any]


class Engine:
    """The engine in this process. Keyword arguments are `radixserve executor`'s flags
    (`max_total_tokens=8192`, `device="cuda:1"`, `disable_radix_cache=True`, ...), checked as
    the command line checks them. Several engines may live in one process, each with its own
    model, KV pool and stepping thread (on a GPU, give each a `mem_fraction_static` that
    leaves room for the others)."""

    def __init__(self, model: str | None = None, *, show_progress: bool = True, **flags: Any):
        a = engine_args(model, flags)
        self.source = resolve_model(a.model, a.served_model_name)
        self.tokenization = Tokenization(self.source)
        grammar_tok = GrammarTokenizer.load(self.source)
        compiled: dict[str, Any] = {}
        grammars = GrammarBackend(
            grammar_tok, compiled.__getitem__, jump_forward=not a.disable_jump_forward
        )
        progress = _Progress(self.source.name) if show_progress else _quiet
        # tp_size=N: this process is rank 0; the others are started as processes of their own
        self.is_embedding = bool(a.is_embedding)
        self.group = ExecutorGroup.start(a, engine_argv(model, flags))
        try:
            step_engine = build_engine(
                settings_from_flags(a, self.source, "engine", "inproc", len(grammar_tok.tokenizer)),
                progress,
                grammars=grammars,
                tp=self.group.tp,
                device=self.group.device,
            )
        except BaseException:
            self.group.close()  # the other ranks, if any, go with it
            raise
        self.group.runner = step_engine.runner
        if isinstance(progress, _Progress):
            progress.done()
        self.pipeline = Pipeline(self.tokenization, step_engine, grammar_tok)
        self.pipeline.compiled = compiled  # the dict the grammars read compiled grammars from

    # -- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        stream: bool = False,
    ) -> Any:
        """One prompt (a string, or `input_ids`): a result; a list of them, or `n` > 1: a
        list of results. With `stream`, an iterator of results, each with all the text so
        far (a batch's carry their `index`)."""
        body = _body(
            prompt,
            sampling_params,
            input_ids,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            rid=rid,
        )
        jobs, many = _checked(lambda: validation.native_jobs(body))
        return self._run(jobs, many, body, stream)

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: dict[str, Any] | None = None,
        *,
        stream: bool = False,
        **logprob_options: Any,
    ) -> Any:
        """A conversation through the model's chat template (a generation prompt added): the
        assistant's reply, in `generate`'s shape."""
        body = _body(None, sampling_params, None, **logprob_options)
        jobs = _checked(lambda: validation.native_chat_jobs(_chat_messages(messages), body))
        return self._run(jobs, len(jobs) > 1, body, stream)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        **options: Any,
    ) -> Any:
        """`generate` for asyncio: awaits the result, or (with `stream=True`) returns an async
        iterator of results. Many calls interleave on the engine's one stepping thread."""
        stream = bool(options.pop("stream", False))
        body = _body(prompt, sampling_params, input_ids, **options)
        jobs, many = _checked(lambda: validation.native_jobs(body))
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[Reply] = asyncio.Queue()

        def put(reply: Reply) -> None:
            loop.call_soon_threadsafe(replies.put_nowait, reply)

        sinks = [Sink(put, collect=not stream) for _ in jobs]
        rids = self.pipeline.submit(jobs, sinks)
        render = _renderer(rids, many, body)
        index = {rid: i for i, rid in enumerate(rids)}

        async def events() -> AsyncIterator[Result]:
            left = len(rids)
            try:
                while left:
                    reply = await replies.get()
                    i = index[reply.rid]
                    if isinstance(reply, Failure):
                        raise _failure(reply)
                    if stream:
                        sinks[i].acc.add(reply)
                        for obj in render.delta_at(i, reply, sinks[i].acc):
                            yield obj
                    left -= reply.finish_reason is not None
            finally:
                if left:  # the caller stopped reading (or was cancelled): stop the rest
                    for rid in rids:
                        self.pipeline.abort(rid)

        if stream:
            return events()
        async for _ in events():
            pass
        return render.body_many([s.acc for s in sinks], _NO_USAGE)

    def _run(self, jobs: list[validation.Job], many: bool, body: GenerateBody, stream: bool) -> Any:
        replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        sinks = [Sink(replies.put, collect=not stream) for _ in jobs]
        rids = self.pipeline.submit(jobs, sinks)
        render = _renderer(rids, many, body)
        index = {rid: i for i, rid in enumerate(rids)}

        def events() -> Iterator[Result]:
            left = len(rids)
            try:
                while left:
                    reply = replies.get()
                    i = index[reply.rid]
                    if isinstance(reply, Failure):
                        raise _failure(reply)
                    if stream:
                        sinks[i].acc.add(reply)
                        yield from render.delta_at(i, reply, sinks[i].acc)
                    left -= reply.finish_reason is not None
            finally:
                if left:  # the caller stopped reading: stop the rest
                    for rid in rids:
                        self.pipeline.abort(rid)

        if stream:
            return events()
        for _ in events():
            pass
        return render.body_many([s.acc for s in sinks], _NO_USAGE)

    def encode(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        dimensions: int | None = None,
    ) -> Any:
        """Embeddings, as SGLang's `Engine.encode`, of an engine started with
        `is_embedding=True` (pooled as `embedding_pooling` says): for one prompt (a string, or
        token ids) `{"embedding": [...], "meta_info": {...}}`, for a list of them a list.
        `dimensions` shortens the vectors where the model declares Matryoshka dimensions."""
        if not self.is_embedding:
            info = ErrorInfo(
                status=400, message="encode needs an engine started with is_embedding=True"
            )
            raise RequestError(info)
        fields: dict[str, Any] = {"input": prompt}
        if dimensions is not None:
            fields["dimensions"] = dimensions
        body = _checked(lambda: validation.decode(msgspec.json.encode(fields), EmbeddingBody))
        jobs = _checked(lambda: embedding_jobs(body, self.source.name))
        one = isinstance(prompt, str) or all(isinstance(x, int) for x in prompt)
        replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        sinks = [Sink(replies.put, collect=True) for _ in jobs]
        rids = self.pipeline.submit(jobs, sinks)
        for _ in rids:  # with collect, each sink hears only its request's last reply
            reply = replies.get()
            if isinstance(reply, Failure):
                raise _failure(reply)
        results = []
        for rid, sink in zip(rids, sinks, strict=True):
            assert sink.acc.embedding is not None
            vector = np.frombuffer(sink.acc.embedding, dtype="<f4").tolist()
            meta = {"id": rid, "prompt_tokens": sink.acc.usage.prompt_tokens}
            results.append({"embedding": vector, "meta_info": meta})
        return results[0] if one else results

    # -- control -----------------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        """Stop the request `rid` (its result ends with finish reason "abort"); False if no
        such request is in flight."""
        return self.pipeline.abort(rid)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests are in flight."""
        return self.pipeline.flush_cache()

    def get_model_info(self) -> dict[str, Any]:
        """What GET /get_model_info answers (with the model's full path)."""
        tok = self.tokenization
        return {
            "model_path": self.source.path,
            "served_model_name": self.source.name,
            "context_length": tok.context_length,
            "architecture": read_architecture(self.source),
            "vocab_size": tok.vocab_size,
            "eos_token_ids": tok.eos_token_ids,
            "has_chat_template": bool(getattr(tok.tokenizer, "chat_template", None)),
            "is_generation": not self.is_embedding,
        }

    def shutdown(self) -> None:
        """Stop the stepping thread (and a tensor-parallel engine's other ranks); the engine
        refuses requests from then on. Its GPU memory is given back, so that a program can
        start another engine after it."""
        self.pipeline.close()
        self.group.close()
        self.group.runner = None
        self.pipeline.release()
        gc.collect()  # the model's modules and graphs hold reference cycles
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0)  # /generate has no usage object


def _body(
    prompt: str | list[str] | None,
    sampling_params: dict[str, Any] | None,
    input_ids: list[int] | list[list[int]] | None,
    **options: Any,
) -> GenerateBody:
    """The /generate body these arguments make, decoded (and refused) as the HTTP API does."""
    fields: dict[str, Any] = {"sampling_params": sampling_params or {}}
    if prompt is not None:
        fields["text"] = prompt
    if input_ids is not None:
        fields["input_ids"] = input_ids
    fields.update({k: v for k, v in options.items() if v is not None})
    return _checked(lambda: validation.decode(msgspec.json.encode(fields), GenerateBody))


def _checked(call: Any) -> Any:
    """`call()`, an API refusal raised as RequestError (a ValueError: the HTTP 400's message,
    its field as `.param`)."""
    try:
        return call()
    except ApiError as e:
        raise RequestError(ErrorInfo(status=e.status, message=e.message, param=e.param)) from None


def _renderer(rids: list[str], many: bool, body: GenerateBody) -> NativeRenderer:
    return NativeRenderer(rids, many, body.return_logprob, body.return_text_in_logprobs)


def _failure(reply: Failure) -> Exception:
    if reply.error.status < 500:
        return RequestError(reply.error)
    return RuntimeError(reply.error.message)


class _Messages(msgspec.Struct):
    messages: list[ChatMessageBody]


def _chat_messages(messages: list[dict[str, str]]) -> list[ChatMessageBody]:
    """The messages decoded as /v1/chat/completions decodes them (the same refusals)."""
    return validation.convert({"messages": messages}, _Messages).messages


class _Progress:
    """The model's load progress on stderr, as `radixserve serve` draws it."""

    def __init__(self, name: str) -> None:
        self.name, self.last = name, ("", -1)

    def __call__(self, phase: str, done: float) -> None:
        mark = (phase, int(done * 10))
        if mark == self.last:
            return
        self.last = mark
        bar = "#" * round(done * 30) + "-" * (30 - round(done * 30))
        end = "" if sys.stderr.isatty() else "\n"
        lead = "\r" if sys.stderr.isatty() else ""
        sys.stderr.write(f"{lead}loading {self.name} [{bar}] {done * 100:3.0f}% {phase}{end}")
        sys.stderr.flush()

    def done(self) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\n")


def _quiet(phase: str, done: float) -> None:
    pass
