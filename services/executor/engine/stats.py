"""Totals the engine keeps for the executor's metrics: plain integers bumped once per step
(or per finished request) on the stepping thread and read when metrics are scraped. Nothing
here runs per token."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.executor.request import Req

# What a launched step was, as the metrics label it: a decode step, an extend run eagerly, or
# an extend run as decode rows replayed from the CUDA graphs (services/executor/extend_rows.py:
# short and cached prompts), whose host time and speed are a decode step's, not an extend's.
PHASES = ("decode", "extend", "extend_rows")


def step_phase(is_decode: bool, as_rows: bool) -> str:
    if is_decode:
        return "decode"
    return "extend_rows" if as_rows else "extend"


@dataclass
class EngineStats:
    decode_steps: int = 0
    extend_steps: int = 0  # eager extends
    rows_steps: int = 0  # extends run as decode rows
    decode_tokens: int = 0  # tokens run through the model by decode steps
    extend_tokens: int = 0  # ... by eager extend steps (prompt chunks, with their first decodes)
    rows_tokens: int = 0  # ... by extends run as decode rows
    generated_tokens: int = 0  # sampled tokens that reached the host
    prompt_tokens: int = 0  # prompts of the requests that finished after their prefill
    cached_tokens: int = 0  # ... of which their KV came from the radix cache
    aborts: Counter[str] = field(default_factory=Counter)  # why requests ended early

    def launched(self, phase: str, tokens: int) -> None:
        if phase == "decode":
            self.decode_steps += 1
            self.decode_tokens += tokens
        elif phase == "extend_rows":
            self.rows_steps += 1
            self.rows_tokens += tokens
        else:
            self.extend_steps += 1
            self.extend_tokens += tokens

    def tokens_by_phase(self) -> dict[str, int]:
        return {"decode": self.decode_tokens, "extend": self.extend_tokens,
                "extend_rows": self.rows_tokens}  # fmt: skip

    def finished(self, ending: Iterable[Req]) -> None:
        """Requests whose final answer this step sends (Outputs.ending: each once): their
        prompts, and what of them the cache held (those that ended before their prefill
        computed nothing)."""
        for r in ending:
            if r.output_ids:
                self.prompt_tokens += len(r.input_ids)
                self.cached_tokens += r.cached_tokens
