"""Sampling over the batch: greedy, temperature, top-k, top-p and min-p, each per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.executor.packing import upload
from shared.messages.common import SamplingParams


@dataclass
class SamplingTensors:
    """Per-request parameters as [bs] tensors on the logits' device."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_p: torch.Tensor  # float32 in (0, 1]
    top_k: torch.Tensor  # int64; vocab size where disabled
    min_p: torch.Tensor  # float32 in [0, 1]
    all_greedy: bool
    need_filter: bool

    @classmethod
    def build(
        cls, params: list[SamplingParams], vocab: int, device: torch.device
    ) -> SamplingTensors:
        if all(p.temperature == 0 for p in params):  # all greedy, in one scan (as below)
            empty = torch.empty(0, device=device)
            return cls(empty, empty, empty, empty, all_greedy=True, need_filter=False)
        temps = [p.temperature for p in params]
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        all_greedy = all(t == 0 or k == 1 for t, k in zip(temps, top_k, strict=True))
        if all_greedy:  # the common case pays for no tensors: sample() only takes the argmax
            empty = torch.empty(0, device=device)
            return cls(empty, empty, empty, empty, all_greedy=True, need_filter=False)
        need_filter = (
            any(k < vocab for k in top_k) or any(p < 1 for p in top_p) or any(m > 0 for m in min_p)
        )
        # One copy for the four, and never a blocking one: `torch.tensor(..., device=cuda)`
        # waits for the whole forward pass queued before it, and the host would stop
        # preparing the next step until the device is done with this one.
        bs = len(params)
        dev = upload(torch.tensor([*temps, *top_p, *min_p, *top_k], dtype=torch.float32), device)
        return cls(
            temperature=dev[:bs],
            top_p=dev[bs : 2 * bs],
            top_k=dev[3 * bs :].long(),  # exact: ids below 2**24
            min_p=dev[2 * bs : 3 * bs],
            all_greedy=all_greedy,
            need_filter=need_filter,
        )


def sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    generator: torch.Generator | None = None,
    row_generators: list[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """logits: [bs, vocab] float32 -> next tokens [bs] int64.

    Rows with their own generator (requests with a seed) draw from it alone, so a seeded
    request samples the same tokens whatever else shares its batch.
    """
    greedy = finite_argmax(logits)
    if st.all_greedy:
        return greedy
    # `not > 0` also catches a NaN temperature; a temperature that underflowed float32 is 0.
    is_greedy = ~(st.temperature > 0) | (st.top_k == 1)
    temps = torch.where(is_greedy, torch.ones_like(st.temperature), st.temperature)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if st.need_filter:
        probs = filter_probs(probs, st.top_k, st.top_p, st.min_p)
    # A row with no usable distribution (inf/NaN logits, a tiny temperature that overflowed
    # the division, everything masked) would make multinomial raise for the whole batch:
    # such a row takes its greedy token instead.
    usable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    is_greedy = is_greedy | ~usable
    probs = torch.where(usable[:, None], probs, torch.ones_like(probs))
    sampled = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    for i, g in enumerate(row_generators or ()):
        if g is not None:
            sampled[i] = torch.multinomial(probs[i], num_samples=1, generator=g)[0]
    return torch.where(is_greedy, greedy, sampled)


def finite_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over each row's finite logits (the first where several tie); token 0 for a
    row with none. A NaN or +inf would otherwise win torch's argmax (NaN counts as the
    largest value).

    On CUDA, kernels/argmax splits each row among programs (torch reduces a one-row batch in
    one block: 28 µs of a batch-1 decode step at Llama 3's vocabulary on an H200).
    """
    if logits.is_cuda:
        from kernels.argmax import finite_argmax_rows

        return finite_argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())
    from kernels.argmax import finite_argmax_ref

    return finite_argmax_ref(logits)


def filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero what top-k, then top-p (on the top-k survivors, renormalised), then min-p remove.

    The most likely token always survives, whatever the parameters: rank 0 is exempt from
    top-p (a top_p like 1e-165 is 0 in float32) and min-p is clamped to [0, 1].
    Returns unnormalised probabilities in vocab order.
    """
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    sorted_p = sorted_p.masked_fill(ranks >= top_k[:, None], 0.0)
    kept = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    # Drop a token when the tokens before it already reach top_p. top_p = 1 is off: the float
    # cumsum can reach 1 before the tail, which would cut that row's tail in a filtered batch.
    before = kept.cumsum(dim=-1) - kept
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1) & (ranks > 0)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    floor = min_p.nan_to_num(0.0).clamp(0.0, 1.0) * sorted_p[:, 0]
    sorted_p = sorted_p.masked_fill((sorted_p < floor[:, None]) & (ranks > 0), 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
