"""Log probabilities of the model's raw distribution, for the requests that ask for them.

They are taken from the logits before grammar masks, penalties and temperature (vLLM's
default, "raw logprobs"): what the model itself thinks of each token.

Output tokens: `SampledLogprobs` is queued on the device with the step's sampling and copied
to the host with its tokens. Prompt tokens: `PromptLogprobTargets` says which positions of an
extend step predict which prompt token; the LM head is applied to their hidden states in
slices, so a long prompt never materialises [tokens, vocab] logits at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.executor.packing import to_device
from services.executor.request import Req, TokenLogprob
from shared.messages.detok import LogprobBlock

MAX_TOP_LOGPROBS = 20  # vLLM's and OpenAI's bound; the gateway refuses more
PROMPT_SLICE = 1024  # positions per LM-head slice for prompt logprobs


@dataclass
class SampledLogprobs:
    """Logprobs of the tokens sampled by some rows of a step (`rows`: indices among the
    step's sampling rows), on the device until `host()` is called after the step's event."""

    rows: list[int]
    ks: list[int]  # top alternatives each row asked for
    chosen: torch.Tensor  # [len(rows)] float32
    top_vals: torch.Tensor | None  # [len(rows), max k]
    top_ids: torch.Tensor | None

    @classmethod
    def want(cls, reqs: Sequence[Req]) -> list[int]:
        return [k for k, r in enumerate(reqs) if r.sampling.return_logprob]

    @classmethod
    def compute(
        cls, logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int]
    ) -> SampledLogprobs:
        """`logprobs`: [len(rows), vocab] log-softmax of the raw logits of those rows;
        `tokens`: every sampling row's token."""
        idx = to_device(rows, torch.int64, tokens.device)
        chosen = logprobs.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1)
        k = max(ks)
        vals = ids = None
        if k:
            vals, ids = logprobs.topk(k, dim=-1)
        if tokens.is_cuda:  # start the copies now; `host` only reads them
            chosen = _to_pinned(chosen)
            vals = _to_pinned(vals) if vals is not None else None
            ids = _to_pinned(ids) if ids is not None else None
        return cls(rows, ks, chosen, vals, ids)

    def host(self) -> dict[int, TokenLogprob]:
        """Row -> its token's logprob; call once the step's tokens are on the host."""
        chosen = self.chosen.tolist()
        vals = self.top_vals.tolist() if self.top_vals is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out = {}
        for j, (row, k) in enumerate(zip(self.rows, self.ks, strict=True)):
            lp = TokenLogprob(float(chosen[j]))
            if k and vals is not None and ids is not None:
                lp.top_ids, lp.top_logprobs = ids[j][:k], vals[j][:k]
            out[row] = lp
        return out


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PromptLogprobTargets:
    """Which token positions of an extend step predict a prompt token somebody asked for."""

    positions: list[int]  # index along the step's token dimension
    targets: list[int]  # the prompt token each position predicts
    owners: list[tuple[Req, int, int]]  # (request, first prompt position, count), in order

    @classmethod
    def build(cls, reqs: Sequence[Req], extend_lens: Sequence[int]) -> PromptLogprobTargets | None:
        positions: list[int] = []
        targets: list[int] = []
        owners: list[tuple[Req, int, int]] = []
        offset = 0
        for req, n in zip(reqs, extend_lens, strict=True):
            start = req.kv_len - n  # the chunk computes positions [start, start + n)
            first, end = req.prompt_logprob_span()
            # Position p predicts prompt token p + 1.
            lo, hi = max(start, first - 1), min(start + n, end - 1)
            if hi > lo:
                positions += range(offset + lo - start, offset + hi - start)
                targets += req.input_ids[lo + 1 : hi + 1]
                owners.append((req, lo + 1, hi - lo))
            offset += n
        return cls(positions, targets, owners) if positions else None

    def compute(self, hidden: torch.Tensor, lm_head: torch.nn.Module) -> None:
        """`hidden`: the final hidden states at `positions`. Stores each request's logprobs
        (blocking: steps that carry prompt logprobs are rare and end the overlap)."""
        k = max(r.sampling.top_logprobs for r, _, _ in self.owners)
        targets = to_device(self.targets, torch.int64, hidden.device)
        chosen: list[float] = []
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        for s in range(0, len(self.targets), PROMPT_SLICE):
            lps = torch.log_softmax(lm_head(hidden[s : s + PROMPT_SLICE]).float(), dim=-1)
            chosen += lps.gather(1, targets[s : s + PROMPT_SLICE, None]).squeeze(1).tolist()
            if k:
                v, i = lps.topk(k, dim=-1)
                top_vals += v.tolist()
                top_ids += i.tolist()
        at = 0
        for req, first, count in self.owners:
            kk = req.sampling.top_logprobs
            for j in range(at, at + count):
                lp = TokenLogprob(chosen[j])
                if kk:
                    lp.top_ids, lp.top_logprobs = top_ids[j][:kk], top_vals[j][:kk]
                req.prompt_logprobs[first + j - at] = lp
            at += count


def block(start: int, token_ids: list[int], lps: Sequence[TokenLogprob | None]) -> LogprobBlock:
    """The wire form; None where a token has no logprob (a prompt's first token)."""
    tops = any(lp is not None and lp.top_ids for lp in lps)
    return LogprobBlock(
        start=start,
        token_ids=token_ids,
        logprobs=[None if lp is None else lp.logprob for lp in lps],
        top_ids=[[] if lp is None else lp.top_ids for lp in lps] if tops else [],
        top_logprobs=[[] if lp is None else lp.top_logprobs for lp in lps] if tops else [],
    )


def prompt_block(req: Req) -> LogprobBlock:
    """The prompt's logprobs from `logprob_start_len` on, once all are computed."""
    start = req.sampling.logprob_start_len
    ids = req.input_ids[start:]
    return block(start, ids, [req.prompt_logprobs.get(p) for p in range(start, start + len(ids))])
