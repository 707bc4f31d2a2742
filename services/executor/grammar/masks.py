"""Grammar masks over a batch: fill the bitmask rows of the constrained requests (on
xgrammar's threads, while the forward pass runs), then apply them to the logits before
sampling, on the device (the Triton kernel of kernels/bitmask.py on CUDA, xgrammar's C++
kernel on the CPU, the torch twin for layouts neither takes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

from services.executor.grammar.matcher import RequestGrammar
from services.executor.packing import to_device


def fill_bitmask(
    grammars: Sequence[RequestGrammar | None],
    bitmask: torch.Tensor,
    batch: xgr.BatchGrammarMatcher | None = None,
) -> list[int]:
    """Fill bitmask row i for every grammars[i] that is not None; the rows filled.

    Row i must be the logits row the request samples from. Rows without a grammar are left as
    they are (`apply_bitmask` skips them). The matchers whose mask is not known already fill
    their rows together through `batch` (a new one if not given), on xgrammar's threads (half
    the cores): at batch 64 one thread would take milliseconds per step.
    """
    assert len(grammars) <= bitmask.shape[0], (
        f"{len(grammars)} rows do not fit a bitmask of {bitmask.shape[0]}"
    )
    rows: list[int] = []
    fresh: list[int] = []
    for i, g in enumerate(grammars):
        if g is None or g.failure is not None:
            continue
        rows.append(i)
        try:
            if not _fill_known(g, bitmask, i):
                fresh.append(i)
        except Exception as e:
            _failed(g, bitmask, i, e)
    if len(fresh) > 1:
        matchers = [grammars[i].matcher for i in fresh]  # type: ignore[union-attr]
        try:
            (batch or xgr.BatchGrammarMatcher()).batch_fill_next_token_bitmask(
                matchers, bitmask, fresh
            )
        except Exception:  # some matcher failed: find which, one row at a time
            pass
        else:
            for i in fresh:
                grammars[i].stats.masks += 1  # type: ignore[union-attr]
            return rows
    for i in fresh:
        g = grammars[i]
        assert g is not None
        try:
            g.matcher.fill_next_token_bitmask(bitmask, i)
            g.stats.masks += 1
        except Exception as e:
            _failed(g, bitmask, i, e)
    return rows


def _fill_known(g: RequestGrammar, bitmask: torch.Tensor, row: int) -> bool:
    """Write bitmask[row] without the matcher when the mask is already known: the one token
    a jump-forward decided for the step in flight, or the mask computed for this state."""
    if g.forced_next is not None:
        t = g.forced_next
        bitmask[row].zero_()
        bitmask[row, t >> 5] = _bit(t)
    elif g.done:
        raise AssertionError("a finished grammar has no next token")
    elif g.state_mask is not None:
        bitmask[row].copy_(g.state_mask[0])
    else:
        return False
    g.stats.masks += 1
    return True


def _bit(token: int) -> int:
    """Token's bit in its int32 bitmask word (bit 31 as a negative value)."""
    b = 1 << (token & 31)
    return b - (1 << 32) if b >= 1 << 31 else b


def _failed(g: RequestGrammar, bitmask: torch.Tensor, row: int, e: Exception) -> None:
    """One request's matcher raised: that request fails when its token lands (see
    `lifecycle.after_token`), and its row allows every token meanwhile, so that the step's
    sampling, shared with other requests, stays well defined."""
    g.failure = f"the grammar matcher failed: {type(e).__name__}: {e}"
    bitmask[row].fill_(-1)


class BatchMasks:
    """The masks of one executor's sampling: a host bitmask (pinned on CUDA, for the async
    copy), grown to the largest batch seen, and xgrammar's batch filler, both owned here."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.bitmask: torch.Tensor | None = None  # [rows, words] int32 on the host
        self._batch: xgr.BatchGrammarMatcher | None = None  # made on the first fill

    def fill(self, grammars: Sequence[RequestGrammar | None], vocab: int) -> list[int]:
        """Fill the rows of the grammars given (row i: grammars[i]); the rows filled.
        `vocab`: the logits' width, which the rows cover."""
        if self.bitmask is None or self.bitmask.shape[0] < len(grammars):
            words = (vocab + 31) // 32
            bitmask = torch.full((max(len(grammars), 64), words), -1, dtype=torch.int32)
            self.bitmask = bitmask.pin_memory() if self.pin_memory else bitmask
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        return fill_bitmask(grammars, self.bitmask, self._batch)

    def apply(self, logits: torch.Tensor, rows: Sequence[int]) -> None:
        """Mask `logits` [len(grammars), vocab] with the rows `fill` wrote."""
        assert self.bitmask is not None, "apply before fill"
        apply_bitmask(logits, self.bitmask, rows)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], backend: str = "auto"
) -> None:
    """Set logits[i, t] = -inf for every token t that bitmask[i] forbids, i in `rows`.

    logits: [bs, vocab] float on any device; bitmask: [>= bs, words] int32, on the CPU where
    `fill_bitmask` wrote it (copied to the logits' device here; pin it for an async copy).
    backend: "auto" (Triton on CUDA, xgrammar's C++ kernel on the CPU, the torch twin for
    layouts neither takes) or a name in BITMASK_BACKENDS.
    """
    if not rows:
        return
    mask = bitmask[: logits.shape[0]]
    if mask.device != logits.device:
        mask = mask.to(logits.device, non_blocking=True)
    if backend == "auto":
        if logits.stride(-1) != 1 or logits.dtype not in _FLOAT_DTYPES:
            backend = "torch"
        else:
            backend = "triton" if logits.is_cuda else "xgrammar"
    BITMASK_BACKENDS[backend](logits, mask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The torch reference of `apply_bitmask` (and of kernels/bitmask.py)."""
    if not rows:
        return
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    idx = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    words = bitmask.to(logits.device).index_select(0, idx)  # [n, words] int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [n, vocab]
    picked = logits.index_select(0, idx)
    picked[:, :vocab].masked_fill_(~allowed, float("-inf"))
    logits[idx] = picked


def _apply_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(rows))


def _apply_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    from kernels.bitmask import apply_token_bitmask  # imports Triton: only on a GPU

    indices = to_device(rows, torch.int32, logits.device)
    apply_token_bitmask(logits=logits, bitmask=bitmask, indices=indices)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITMASK_BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor, Sequence[int]], None]] = {
    "triton": _apply_triton,
    "xgrammar": _apply_xgrammar,
    "torch": apply_bitmask_torch,
}
