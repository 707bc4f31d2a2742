"""Totals the engine keeps for the executor's metrics: plain integers bumped once per step
(or per finished request) on the stepping thread and read when metrics are scraped. Nothing
here runs per token."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.executor.request import Req


@dataclass
class EngineStats:
    decode_steps: int = 0
    extend_steps: int = 0
    decode_tokens: int = 0  # tokens run through the model by decode steps
    extend_tokens: int = 0  # ... by extend steps (prompt chunks, with their first decodes)
    generated_tokens: int = 0  # sampled tokens that reached the host
    prompt_tokens: int = 0  # prompts of the requests that finished after their prefill
    cached_tokens: int = 0  # ... of which their KV came from the radix cache
    aborts: Counter[str] = field(default_factory=Counter)  # why requests ended early

    def launched(self, is_decode: bool, tokens: int) -> None:
        if is_decode:
            self.decode_steps += 1
            self.decode_tokens += tokens
        else:
            self.extend_steps += 1
            self.extend_tokens += tokens

    def finished(self, ending: Iterable[Req]) -> None:
        """Requests whose final answer this step sends (Outputs.ending: each once): their
        prompts, and what of them the cache held (those that ended before their prefill
        computed nothing)."""
        for r in ending:
            if r.output_ids:
                self.prompt_tokens += len(r.input_ids)
                self.cached_tokens += r.cached_tokens
