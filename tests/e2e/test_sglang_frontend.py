"""SGLang's own frontend language (the `sglang` package's RuntimeEndpoint, unmodified) driving
`radixserve serve`: gen, select, fork, roles, regex, dtype=int, run_batch, flush_cache and
get_server_info, each checked against transformers on the same weights where it computes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.e2e.stack import Stack
from tests.executor.helpers import hf_greedy

# sglang imports IPython, which raises the process's recursion limit to 3,000: other tests in
# this process (the gateway's 1,000-deep nesting refusal) rely on the default.
_limit = sys.getrecursionlimit()
import sglang as sgl  # noqa: E402

sys.setrecursionlimit(_limit)

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def backend(tiny_stack: Stack) -> Iterator[Any]:
    endpoint = sgl.RuntimeEndpoint(tiny_stack.base_url)
    sgl.set_default_backend(endpoint)
    yield endpoint
    sgl.set_default_backend(None)


def greedy_text(hf: torch.nn.Module, tok: Any, text: str, n: int) -> str:
    """What greedy decoding of `text` gives (the frontend sends text; the tokenizer adds BOS
    as radixserve's does)."""
    out = hf_greedy(hf, tok.encode(text), n)
    return str(tok.decode(out, skip_special_tokens=True))


def test_gen_is_the_greedy_continuation(backend: Any, tiny_hf: Any, tiny_tokenizer: Any) -> None:
    @sgl.function
    def program(s: Any) -> None:
        s += "The capital of France is"
        s += sgl.gen("a", max_tokens=8, temperature=0)

    state = program.run()
    assert state["a"] == greedy_text(tiny_hf, tiny_tokenizer, "The capital of France is", 8)
    meta = state.get_meta_info("a")
    assert meta["completion_tokens"] >= 1 and meta["finish_reason"]["type"] in ("length", "stop")


def _logprobs(hf: torch.nn.Module, ids: list[int]) -> list[float]:
    """log P(ids[p] | ids[:p]) for every position p >= 1."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(lp[p - 1, ids[p]]) for p in range(1, len(ids))]


def brute_force_select(hf: torch.nn.Module, tok: Any, prefix: str, choices: list[str]) -> str:
    """SGLang's token-length-normalised choice, computed from transformers' logprobs: the
    mean logprob of the choice's prompt from two tokens before its end (token healing), the
    first of those dropped when the prefix already ends with that token's text."""
    start = max(len(tok.encode(prefix)) - 2, 0)
    scores = []
    for c in choices:
        ids = tok.encode(prefix + c)
        lps = _logprobs(hf, ids)  # lps[p - 1] is position p's
        window = [(lps[p - 1] if p > 0 else None, ids[p]) for p in range(start, len(ids))]
        values = [v for v, _ in window if v]
        score = sum(values) / len(values)
        first_text = tok.decode([window[0][1]])
        if prefix.endswith(first_text) and window[0][0] is not None:
            score = (score * len(window) - window[0][0]) / (len(window) - 1)
        scores.append(score)
    return choices[max(range(len(choices)), key=lambda i: scores[i])]


def test_select_picks_the_choice_a_brute_force_scoring_picks(
    backend: Any, tiny_hf: Any, tiny_tokenizer: Any
) -> None:
    choices = ["red", "blue", "green", "the sea"]

    @sgl.function
    def program(s: Any, prefix: str) -> None:
        s += prefix
        s += sgl.select("c", choices=choices)

    for prefix in ("Pick one:", "The colour of the sky is", "I like"):
        state = program.run(prefix=prefix)
        assert state["c"] == brute_force_select(tiny_hf, tiny_tokenizer, prefix, choices), prefix


def test_fork_shares_the_prefix_through_the_cache(backend: Any) -> None:
    @sgl.function
    def program(s: Any) -> None:
        s += "A shared prefix, long enough to be worth caching. " * 4
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"Branch {i}:"
            f += sgl.gen("b", max_tokens=4, temperature=0)
        s["cached"] = [f.get_meta_info("b")["cached_tokens"] for f in forks]
        s += "Joined: " + " | ".join(f["b"] for f in forks)

    state = program.run()
    prefix_len = 4 * 10  # about ten tokens a sentence, at least
    # The frontend caches the prefix before forking when its text is already there; when not
    # (it is added lazily), the branches arrive together and one computes it for the others.
    assert all(c >= prefix_len for c in sorted(state["cached"])[1:]), state["cached"]
    assert state.text().startswith("A shared prefix") and "Joined: " in state.text()


def test_roles_go_through_the_chat_template(
    backend: Any, tiny_hf: Any, tiny_tokenizer: Any
) -> None:
    @sgl.function
    def program(s: Any) -> None:
        s += sgl.system("You are terse.")
        s += sgl.user("Say hi")
        s += sgl.assistant(sgl.gen("r", max_tokens=6, temperature=0))

    state = program.run()
    text = state.text()
    assert "You are terse." in text and "Say hi" in text
    before = text[: text.rindex(state["r"])] if state["r"] else text
    assert state["r"] == greedy_text(tiny_hf, tiny_tokenizer, before, 6)


def test_regex_and_int_are_enforced(backend: Any) -> None:
    import re

    @sgl.function
    def program(s: Any) -> None:
        s += "Number:"
        s += sgl.gen("n", max_tokens=8, regex=r"[0-9]{2}")
        s += " Age:"
        s += sgl.gen("age", max_tokens=8, dtype=int)

    for _ in range(3):
        state = program.run(temperature=1.0)
        assert re.fullmatch(r"[0-9]{2}", state["n"]), state["n"]
        int(state["age"])  # a random model writes a number only when the grammar ran


def test_run_batch_runs_the_programs_together(backend: Any, tiny_stack: Stack) -> None:
    @sgl.function
    def program(s: Any, i: int) -> None:
        s += f"Story {i}:"
        # Long enough for heartbeats (every 0.5 s) to see the batch on a faster machine too:
        # 128 tokens took 1.3 s on 2 cores, 400 took 7.9 (each step attends over more)
        s += sgl.gen("story", max_tokens=200, temperature=0, ignore_eos=True)

    states, most_running = tiny_stack.most_running_during(
        lambda: program.run_batch([{"i": i} for i in range(32)], num_threads=32)
    )
    assert len(states) == 32 and all(len(s["story"]) > 0 for s in states)
    assert most_running > 8, most_running  # decoded side by side, not one after another


def test_flush_cache_and_server_info(backend: Any, tiny_stack: Stack) -> None:
    tiny_stack.wait_idle()
    sgl.flush_cache()  # raises on a refusal
    beat = tiny_stack.wait_idle()
    assert beat.executor is not None and beat.executor.cached_tokens == 0
    info = sgl.get_server_info()
    assert len(info["instances"]["executor"]) == 1 and len(info["executors"]) == 1
