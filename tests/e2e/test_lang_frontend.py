"""radixserve.lang, the frontend language, on both of its backends: a `radixserve serve` stack
over HTTP (RuntimeEndpoint) and a radixserve.Engine in this process. What it computes is
checked against transformers on the same weights, and against SGLang's own frontend."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import radixserve.lang as rl
from radixserve import Engine
from tests.e2e.stack import Stack
from tests.e2e.test_sglang_frontend import brute_force_select, greedy_text

_limit = sys.getrecursionlimit()  # as in test_sglang_frontend: IPython raises it
import sglang as sgl  # noqa: E402

sys.setrecursionlimit(_limit)

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model_dir), device="cpu", max_total_tokens=8192, show_progress=False) as e:
        yield e


@pytest.fixture(params=["http", "engine"])
def backend(request: pytest.FixtureRequest, tiny_stack: Stack) -> Any:
    if request.param == "http":
        return rl.RuntimeEndpoint(tiny_stack.base_url)
    return rl.EngineBackend(request.getfixturevalue("engine"))


def test_gen_is_the_greedy_continuation(backend: Any, tiny_hf: Any, tiny_tokenizer: Any) -> None:
    @rl.function
    def program(s: Any, prompt: str) -> None:
        s += prompt
        s += rl.gen("a", max_tokens=8, temperature=0)

    for prompt in ("The capital of France is", "one two three"):
        state = program.run(prompt, backend=backend)
        assert state["a"] == greedy_text(tiny_hf, tiny_tokenizer, prompt, 8)
        assert state.text() == prompt + state["a"]
        meta = state.get_meta_info("a")
        assert meta is not None and meta["completion_tokens"] >= 1


def test_select_picks_what_brute_force_scoring_picks(
    backend: Any, tiny_hf: Any, tiny_tokenizer: Any
) -> None:
    choices = ["red", "blue", "green", "the sea"]

    @rl.function
    def program(s: Any, prefix: str) -> None:
        s += prefix
        s += rl.select("c", choices=choices)

    for prefix in ("Pick one:", "The colour of the sky is", "I like"):
        state = program.run(prefix=prefix, backend=backend)
        assert state["c"] == brute_force_select(tiny_hf, tiny_tokenizer, prefix, choices), prefix
        assert state.text() == prefix + state["c"]
        scores = state.get_meta_info("c")["normalized_prompt_logprobs"]
        assert len(scores) == 4 and scores[choices.index(state["c"])] == max(scores)


def test_fork_branches_reuse_the_cached_prefix_and_join(backend: Any) -> None:
    prefix = "A shared prefix, long enough to be worth caching. " * 4

    @rl.function
    def program(s: Any) -> None:
        s += prefix
        forks = s.fork(4)
        forks += lambda i: f"Branch {i}:"
        forks += rl.gen("b", max_tokens=4, temperature=0)
        s["cached"] = [f.get_meta_info("b")["cached_tokens"] for f in forks]
        s["texts"] = [f.text() for f in forks]
        forks.join()

    state = program.run(backend=backend)
    # The prefix is cached before the branches start: every branch reuses it, none computes it.
    assert all(c >= 40 for c in state["cached"]), state["cached"]
    assert len(state["b"]) == 4  # gathered onto the parent, a list in branch order
    for i, (text, b) in enumerate(zip(state["texts"], state["b"], strict=True)):
        assert text == f"{prefix}Branch {i}:{b}"
    assert state.text() == prefix  # branches do not write into the parent


def test_join_concate_and_append_appends_the_branches_text(backend: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += "Steps:"
        forks = s.fork(2)
        forks += [" one", " two"]
        forks.join("concate_and_append")
        s += rl.gen("after", max_tokens=3, temperature=0)

    state = program.run(backend=backend)
    assert state.text() == "Steps: one two" + state["after"]


def test_roles_render_the_chat_template(backend: Any, tiny_hf: Any, tiny_tokenizer: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += rl.system("You are terse.")
        with s.user():
            s += "Say hi"
        s += rl.assistant(rl.gen("r", max_tokens=6, temperature=0))

    state = program.run(backend=backend)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": state["r"]},
    ]
    assert state.messages() == messages
    assert state.text() == tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tiny_tokenizer.apply_chat_template(
        messages[:2], tokenize=False, add_generation_prompt=True
    )
    assert state["r"] == greedy_text(tiny_hf, tiny_tokenizer, prompt, 6)


def test_a_gen_inside_a_user_turn_sees_the_role_header(backend: Any, tiny_tokenizer: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += rl.user_begin()
        s["inside"] = s.text()
        s += "Continue:" + rl.gen("u", max_tokens=3, temperature=0)
        s += rl.user_end()

    state = program.run(backend=backend)
    full = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "@"}], tokenize=False)
    assert state["inside"] == full[: full.index("@")]  # "<|im_start|>user\n"
    assert state.messages() == [{"role": "user", "content": "Continue:" + state["u"]}]


def test_constraints_are_enforced(backend: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += "Number:"
        s += rl.gen("n", max_tokens=8, regex=r"[0-9]{2}")
        s += " Age:"
        s += rl.gen_int("age", max_tokens=8)
        s += " Name:"
        s += rl.gen_string("name", max_tokens=12)
        s += " JSON:"
        s += rl.gen(
            "j",
            max_tokens=24,
            json_schema={
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        )

    for _ in range(3):
        state = program.run(temperature=1.0, backend=backend)
        assert re.fullmatch(r"[0-9]{2}", state["n"]), state["n"]
        assert re.fullmatch(r"[-+]?[0-9]+", state["age"]), state["age"]
        if state.get_meta_info("name")["finish_reason"]["type"] != "length":
            assert re.fullmatch(r"\"[^\"\n]*\"", state["name"]), state["name"]
        if state.get_meta_info("j")["finish_reason"]["type"] != "length":
            assert re.fullmatch(r"\{\s*\"ok\"\s*:\s*(true|false)\s*\}", state["j"]), state["j"]


def test_stream_yields_the_text_as_it_is_generated(backend: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += "Count:"
        s += rl.gen("a", max_tokens=12, temperature=0, ignore_eos=True)
        s += " then"
        s += rl.gen("b", max_tokens=6, temperature=0, ignore_eos=True)

    state = program.run(stream=True, backend=backend)
    pieces = list(state.text_iter())
    assert len(pieces) > 4  # a piece per token or so, not one block
    assert "".join(pieces) == state.text() == "Count:" + state["a"] + " then" + state["b"]
    assert "".join(state.text_iter("b")) == state["b"]  # read again, after the fact


def test_a_streamed_chat_includes_the_templates_text(backend: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += rl.system("Be brief.")
        s += rl.user("Hello")
        s += rl.assistant(rl.gen("r", max_tokens=5, temperature=0))

    state = program.run(stream=True, backend=backend)
    assert "".join(state.text_iter()) == state.text()
    assert state.text().endswith("<|im_end|>\n")  # ChatML's end of turn, streamed too


def test_run_batch_returns_every_program_in_order(backend: Any) -> None:
    @rl.function
    def program(s: Any, i: int) -> None:
        s += f"Story {i}:"
        s += rl.gen("story", max_tokens=6, temperature=0)

    states = program.run_batch(
        [{"i": i} for i in range(24)], backend=backend, num_threads=8, progress_bar=True
    )
    assert [s.text() for s in states] == [f"Story {i}:" + s["story"] for i, s in enumerate(states)]
    one = program.run(5, backend=backend)
    assert states[5]["story"] == one["story"]
    lazily = program.run_batch([7, 3], backend=backend, generator_style=True)
    assert [s["story"] for s in lazily] == [states[7]["story"], states[3]["story"]]


def test_a_refused_generation_is_raised_where_the_state_is_read(backend: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += "x"
        s += rl.gen("a", max_tokens=4, temperature=-1)
        s += rl.gen("b", max_tokens=4)

    state = program.run(backend=backend)
    err = state.error()
    assert isinstance(err, rl.BackendError) and "temperature" in str(err)
    with pytest.raises(rl.ProgramError, match="temperature"):
        state["a"]
    assert state.executor.text == "x"  # what followed the failure did not run


def test_the_programs_own_exception_reaches_the_caller(backend: Any) -> None:
    @rl.function
    def program(s: Any) -> None:
        s += "x"
        raise LookupError("the program's own bug")

    with pytest.raises(LookupError, match="own bug"):
        program.run(backend=backend)
    with pytest.raises(TypeError, match="program"):
        program.run(1, backend=backend)  # no such argument: refused before anything runs


def test_run_batch_of_32_decodes_them_side_by_side(tiny_stack: Stack) -> None:
    @rl.function
    def program(s: Any, i: int) -> None:
        s += f"Story {i}:"
        # Long enough for heartbeats (every 0.5 s) to see the batch on a faster machine too:
        # 128 tokens took 1.3 s on 2 cores, 400 took 7.9 (each step attends over more)
        s += rl.gen("story", max_tokens=200, temperature=0, ignore_eos=True)

    backend = rl.RuntimeEndpoint(tiny_stack.base_url)
    states, most_running = tiny_stack.most_running_during(
        lambda: program.run_batch([{"i": i} for i in range(32)], backend=backend)
    )
    assert all(len(s["story"]) > 0 for s in states)
    assert most_running > 8, most_running  # decoded side by side, not one after another


def test_a_program_for_sglang_runs_with_the_import_changed(tiny_stack: Stack) -> None:
    import radixserve.lang as sgl  # what the user changes; the rest is SGLang's own API

    @sgl.function
    def program(s: Any, q: str) -> None:
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("a", max_tokens=4, temperature=0, stop=["\n"]))

    sgl.set_default_backend(sgl.RuntimeEndpoint(tiny_stack.base_url))
    try:
        state = program.run(q="hi")
        assert state.messages()[1] == {"role": "assistant", "content": state["a"]}
        assert [s["a"] for s in program.run_batch([{"q": "hi"}])] == [state["a"]]
    finally:
        sgl.set_default_backend(None)


def test_flush_cache_and_server_info(backend: Any) -> None:
    rl.flush_cache(backend)
    assert rl.get_server_info(backend)


def test_the_same_program_gives_what_sglang_gives(tiny_stack: Stack) -> None:
    """One program, written once against each frontend's names, run on the same server. (No
    roles: SGLang's frontend picks its own template by model name, radixserve.lang uses the
    model's.)"""

    def body(lib: Any) -> Any:
        def program(s: Any, topic: str) -> None:
            s += f"Topic: {topic}.\nAnswer:"
            s += lib.gen("answer", max_tokens=6, temperature=0)
            s += "\nRight?"
            s += lib.select("yn", choices=["yes", "no", "maybe not"])
            forks = s.fork(2)
            for i, f in enumerate(forks):
                f += f" Reason {i}:" + lib.gen("why", max_tokens=4, temperature=0)
            forks.join()

        return lib.function(program)

    jobs = [{"topic": t} for t in ("colour", "city", "river")]
    theirs = body(sgl).run_batch(jobs, backend=sgl.RuntimeEndpoint(tiny_stack.base_url))
    ours = body(rl).run_batch(jobs, backend=rl.RuntimeEndpoint(tiny_stack.base_url))
    for a, b in zip(theirs, ours, strict=True):
        assert a.text() == b.text()
        assert (a["answer"], a["yn"], a["why"]) == (b["answer"], b["yn"], b["why"])
