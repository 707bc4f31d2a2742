"""Per-step logits processors: logit bias, min tokens, and the repetition, frequency and
presence penalties, each per request and vectorised over the batch.

The semantics are vLLM's, applied in this order to a step's float32 logits, row by row:

1. logit bias: `logit[t] += bias` for every `t: bias` in `logit_bias`; ids outside
   [0, vocab) are ignored (the tokenizer validates them against its vocabulary).
2. min tokens: while the sampled token's output index is below `min_new_tokens`,
   `logit[t] = -inf` for every `t` in `stop_ids` (tokens still on the device count: the index
   is given, not derived from what the host knows).
3. repetition penalty `p` (1.0 = off), for every token `t` of the prompt or the output:
   `logit[t] = logit[t] / p if logit[t] > 0 else logit[t] * p`.
4. frequency `f` and presence `r` penalties (0.0 = off), over the output only:
   `logit[t] -= f * count(t)`, then `logit[t] -= r` if `count(t) > 0`.

The penalties read only the output tokens the host knows; `needs_history` tells the engine not
to launch such a request's next step before the values are known. Rows that need none of this
are left bit-identical. History token ids are in [0, vocab): the tokenizer checks prompt ids and the
sampler only draws from the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.executor.packing import upload
from shared.messages.common import SamplingParams


class TokenHistory(Protocol):
    """What a processor reads of a request; `services.executor.request.Req` satisfies it."""

    sampling: SamplingParams
    input_ids: list[int]  # the prompt
    output_ids: list[int]  # generated so far, as far as the host knows
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids


def needs_history(p: SamplingParams) -> bool:
    """The request has a penalty on, so it needs the value of every output token."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass
class LogitsProcessor:
    """One step's processing of a batch's logits: `build` gathers the index data on the host,
    `apply` runs on the device. Each pair of index tensors addresses (row, token) entries;
    empty tensors mean the stage is skipped."""

    rows: int
    vocab: int
    bias_rows: torch.Tensor  # [n_bias] int64 batch rows
    bias_cols: torch.Tensor  # [n_bias] int64 token ids
    bias_vals: torch.Tensor  # [n_bias] float32
    mask_rows: torch.Tensor  # [n_mask] batch rows still under min_new_tokens
    mask_cols: torch.Tensor  # [n_mask] their stop ids
    pen_rows: torch.Tensor  # [m] batch rows with a penalty on
    seen_rows: torch.Tensor  # index into pen_rows, per prompt + output token (repetition rows)
    seen_cols: torch.Tensor
    out_rows: torch.Tensor  # index into pen_rows, per output token (frequency/presence rows)
    out_cols: torch.Tensor
    repetition: torch.Tensor  # [m] float32
    frequency: torch.Tensor  # [m] float32
    presence: torch.Tensor  # [m] float32

    @classmethod
    def build(
        cls,
        rows: Sequence[TokenHistory],
        positions: Sequence[int],
        vocab: int,
        device: torch.device,
    ) -> LogitsProcessor | None:
        """`positions[i]`: the output index of the token row i samples. None when no row
        needs anything (the common case: one scan of the params)."""
        if not any(
            r.sampling.logit_bias or pos < r.sampling.min_new_tokens or needs_history(r.sampling)
            for r, pos in zip(rows, positions, strict=True)
        ):
            return None
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        pen_rows: list[int] = []
        seen_rows: list[int] = []
        seen_cols: list[int] = []
        out_rows: list[int] = []
        out_cols: list[int] = []
        repetition: list[float] = []
        frequency: list[float] = []
        presence: list[float] = []
        for i, (r, pos) in enumerate(zip(rows, positions, strict=True)):
            p = r.sampling
            for t, b in p.logit_bias.items():
                if 0 <= t < vocab:
                    bias_rows.append(i)
                    bias_cols.append(t)
                    bias_vals.append(b)
            if pos < p.min_new_tokens:
                stops = [t for t in r.stop_ids if 0 <= t < vocab]
                mask_rows += [i] * len(stops)
                mask_cols += stops
            if not needs_history(p):
                continue
            j = len(pen_rows)
            pen_rows.append(i)
            repetition.append(p.repetition_penalty)
            frequency.append(p.frequency_penalty)
            presence.append(p.presence_penalty)
            out = r.output_ids
            if p.repetition_penalty != 1.0:
                seen_rows += [j] * (len(r.input_ids) + len(out))
                seen_cols += r.input_ids
                seen_cols += out
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                out_rows += [j] * len(out)
                out_cols += out
        ints = [bias_rows, bias_cols, mask_rows, mask_cols, pen_rows]
        ints += [seen_rows, seen_cols, out_rows, out_cols]
        floats = [bias_vals, repetition, frequency, presence]
        # One host-to-device copy: the float32 values travel bitcast as int32 after the ids.
        n_int = sum(len(x) for x in ints)
        ids = torch.tensor(list(itertools.chain.from_iterable(ints)), dtype=torch.int32)
        values = torch.tensor(list(itertools.chain.from_iterable(floats)), dtype=torch.float32)
        dev = upload(torch.cat([ids, values.view(torch.int32)]), device)
        br, bc, mr, mc, pr, sr, sc, or_, oc = dev[:n_int].long().split([len(x) for x in ints])
        bv, rep, freq, pres = dev[n_int:].view(torch.float32).split([len(x) for x in floats])
        return cls(
            rows=len(rows),
            vocab=vocab,
            bias_rows=br,
            bias_cols=bc,
            bias_vals=bv,
            mask_rows=mr,
            mask_cols=mc,
            pen_rows=pr,
            seen_rows=sr,
            seen_cols=sc,
            out_rows=or_,
            out_cols=oc,
            repetition=rep,
            frequency=freq,
            presence=pres,
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Process `logits` [rows, vocab] float32 in place."""
        if logits.shape != (self.rows, self.vocab) or logits.dtype != torch.float32:
            raise ValueError(
                f"logits must be float32 [{self.rows}, {self.vocab}], "
                f"got {logits.dtype} {list(logits.shape)}"
            )
        if self.bias_rows.numel():
            logits.index_put_((self.bias_rows, self.bias_cols), self.bias_vals, accumulate=True)
        if self.mask_rows.numel():
            logits[self.mask_rows, self.mask_cols] = float("-inf")
        if not self.pen_rows.numel():
            return
        shape = (self.pen_rows.numel(), self.vocab)
        sub = logits.index_select(0, self.pen_rows)  # [m, vocab], a copy
        if self.seen_cols.numel():
            seen = torch.zeros(shape, dtype=torch.bool, device=logits.device)
            seen[self.seen_rows, self.seen_cols] = True
            p = self.repetition[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / p, sub * p), sub)
        if self.out_cols.numel():
            counts = torch.zeros(shape, dtype=torch.float32, device=logits.device)
            ones = torch.ones(self.out_cols.shape, dtype=torch.float32, device=logits.device)
            counts.index_put_((self.out_rows, self.out_cols), ones, accumulate=True)
            # Rows with f = r = 0 (repetition only) subtract exact zeros: left unchanged.
            sub -= self.frequency[:, None] * counts
            sub -= self.presence[:, None] * (counts > 0)
        logits.index_copy_(0, self.pen_rows, sub)
