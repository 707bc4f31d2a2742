"""Token logprobs in each API's own shape.

- completions (OpenAI's legacy shape): parallel lists `tokens`, `token_logprobs`,
  `top_logprobs` (a dict per position: the top alternatives and the chosen token) and
  `text_offset` (where each token starts in the choice's text);
- chat: `content`, a list of {token, logprob, bytes, top_logprobs};
- native (SGLang's shape): [logprob, token_id, text or None] triples.
A prompt's first token has no logprob (null). JSON has no -inf: values are clamped, as vLLM
does.
"""

from __future__ import annotations

from typing import Any

from shared.messages.reply import TokenLogprob

FLOOR = -9999.0


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, FLOOR)


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[dict[str, Any], int]:
    """The `logprobs` object of a completion choice (or chunk) whose text starts at `offset`;
    returns it with the offset after its tokens."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float | None] | None] = []
    offsets: list[int] = []
    for e in entries:
        tokens.append(e.token)
        lps.append(_lp(e.logprob))
        offsets.append(offset)
        offset += len(e.token)
        if e.logprob is None:
            tops.append(None)
            continue
        top = {t.token: _lp(t.logprob) for t in e.top}
        top.setdefault(e.token, _lp(e.logprob))
        tops.append(top)
    body = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
    return body, offset


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _lp(e.logprob),
                "bytes": e.bytes,
                "top_logprobs": [
                    {"token": t.token, "logprob": _lp(t.logprob), "bytes": t.bytes} for t in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def native_logprobs(
    entries: list[TokenLogprob], with_text: bool
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's `*_token_logprobs` and `*_top_logprobs` lists."""
    chosen: list[list[Any]] = []
    top: list[list[list[Any]] | None] = []
    for e in entries:
        chosen.append([_lp(e.logprob), e.token_id, e.token if with_text else None])
        top.append(
            [[_lp(t.logprob), t.token_id, t.token if with_text else None] for t in e.top]
            if e.logprob is not None
            else None
        )
    return chosen, top


def cumulative_logprob(entries: list[TokenLogprob]) -> float:
    """What best_of ranks samples by."""
    return sum(e.logprob for e in entries if e.logprob is not None)
