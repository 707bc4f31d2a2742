"""A request inside the executor, and the rule for when it is finished."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.executor.cache import TreeNode
from services.executor.engine.timeline import Timeline
from services.executor.grammar.matcher import RequestGrammar
from shared.messages.common import HopTimes, SamplingParams
from shared.messages.schedule import TokenizedRequest


@dataclass
class TokenLogprob:
    """One token's log probability and its position's most likely alternatives."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False)  # identity: the batch lists look requests up with `in` and `remove`
class Req:
    rid: str
    input_ids: list[int]  # the prompt
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    detok_stream: str
    deadline: float
    seq: int  # arrival order; retraction picks the youngest
    output_ids: list[int] = field(default_factory=list)  # output tokens known on the host
    # Output tokens sampled (or being sampled) on the device whose values have not reached
    # the host: they follow `output_ids`. At most two (with overlap: the token of the step in
    # flight and of the one launched after it).
    pending: int = 0
    row: int = -1  # row in req_to_token while resident, else -1
    slots: list[int] = field(default_factory=list)  # KV slots of all_ids[: len(slots)]
    locked_node: TreeNode | None = None  # the cache prefix this request holds a lock on
    locked_len: int = 0  # slots[:locked_len] belong to the cache
    waits: int = 0  # admissions that passed this request over (starvation guard)
    finish: str | None = None  # "stop" | "length" | "abort"
    matched_stop_token: int | None = None
    sent: int = 0  # output tokens already published
    finish_sent: bool = False  # the final delta went out
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    # made resident before: a retracted request comes back with its output, and text a
    # grammar forced at the start is output before the first admission, so neither tells
    attached: bool = False
    limit_len: int = 0  # prompt + output may not grow past this (max_tokens, context)
    grammar: RequestGrammar | None = None  # structured output: the request's matcher
    forced_tokens: int = 0  # output tokens appended by jump-forward (forward passes saved)
    _generator: torch.Generator | None = None  # a seeded request's own random stream
    out_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # output index ->
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # prompt position ->
    prompt_logprobs_sent: bool = False
    hops: HopTimes | None = None  # the trace's stamps, then the executor's; sent once
    # max_new_tokens 0 (SGLang's): the prompt is computed (cached, its logprobs taken) and the
    # request ends there, "length", without sampling anything
    prefill_only: bool = False
    # An embedding request (prefill-only): how its prompt is pooled, the running float32 sum
    # of its chunks' hidden states, and once its prompt is computed the normalised vector.
    pooling: str | None = None
    dimensions: int = 0  # keep the vector's first n values (0: all)
    pool_sum: torch.Tensor | None = None
    embedding: torch.Tensor | None = None
    timeline: Timeline | None = None  # while tracing: when it passed each point (spans)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own generator when it has a seed (made on first use)."""
        if self.sampling.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
        return self._generator

    @classmethod
    def from_message(cls, m: TokenizedRequest, seq: int, context_length: int) -> Req:
        stop = set(m.sampling.stop_token_ids)
        if not m.sampling.ignore_eos:
            stop.update(m.eos_token_ids)
        # Resumed from a lost executor: the output so far is prefilled after the prompt, like
        # a retracted request's, and only what follows it is sent. The first delta (its prompt
        # logprobs, its first-token timings) went out from the lost executor.
        resumed = bool(m.resume_ids)
        return cls(
            rid=m.trace.rid,
            input_ids=list(m.input_ids),
            sampling=m.sampling,
            max_new_tokens=m.max_new_tokens,
            stop_ids=frozenset(stop),
            detok_stream=m.detok_stream,
            deadline=m.trace.deadline,
            seq=seq,
            output_ids=list(m.resume_ids),
            sent=len(m.resume_ids),
            limit_len=min(context_length, len(m.input_ids) + m.max_new_tokens),
            prompt_logprobs_sent=resumed,
            hops=None if resumed else m.trace.hops,
            prefill_only=m.max_new_tokens == 0,
        )

    @property
    def all_len(self) -> int:
        """Prompt, known output and pending output tokens."""
        return len(self.input_ids) + len(self.output_ids) + self.pending

    @property
    def known_len(self) -> int:
        """Prompt and output tokens whose values the host knows."""
        return len(self.input_ids) + len(self.output_ids)

    def prompt_logprob_span(self) -> tuple[int, int]:
        """Prompt positions [first, end) whose logprobs are still to be computed; empty when
        none are wanted (the first token has none: nothing predicts it)."""
        start = self.sampling.logprob_start_len
        if start < 0 or self.prompt_logprobs_sent:
            return 0, 0
        return max(start, 1), len(self.input_ids)

    @property
    def match_limit(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last one, and
        none whose position a prompt logprob still needs computed."""
        if self.pooling == "mean":  # every token's hidden state is pooled: compute them all
            return 0
        first, end = self.prompt_logprob_span()
        limit = self.all_len - 1
        return min(limit, first - 1) if end > first else limit

    @property
    def kv_len(self) -> int:
        return len(self.slots)

    @property
    def pending_len(self) -> int:
        """Tokens without KV yet: the unprefilled prompt, or the last sampled token."""
        return self.all_len - self.kv_len

    def token_range(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) of prompt + output, without joining the two (decode asks
        for one token of a long sequence every step)."""
        assert end <= self.known_len, f"tokens up to {end} asked, {self.known_len} known"
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    @property
    def exhausted(self) -> bool:
        """No more tokens may be sampled, whatever the pending ones turn out to be."""
        return self.all_len >= self.limit_len

    def begin_token(self) -> int:
        """A token of this request is being sampled on the device; its output index."""
        self.pending += 1
        return len(self.output_ids) + self.pending - 1

    def land(self, index: int, token: int) -> None:
        """The sampled value of output `index` reached the host: record it and decide
        whether the request is done. Tokens land in order; a token whose value the host
        already knew (text a grammar forced while it was in flight, see grammar.lifecycle)
        changes nothing."""
        if self.finish is not None:
            return  # finished (or aborted) while this token was in flight: dropped
        if index < len(self.output_ids):
            return  # known ahead of time; `pending` already counted it out
        assert index == len(self.output_ids) and self.pending > 0, "tokens land in order"
        self.output_ids.append(token)
        self.pending -= 1
        n = index + 1
        # A stop token counts only after min_new_tokens others (the sampler masks it before).
        if token in self.stop_ids and index >= self.sampling.min_new_tokens:
            self.finish, self.matched_stop_token = "stop", token
        elif len(self.input_ids) + n >= self.limit_len:
            self.finish = "length"
        if self.finish is not None:
            self.pending = 0  # a token sampled after this one, in flight, is discarded
            for i in [i for i in self.out_logprobs if i >= n]:
                del self.out_logprobs[i]
