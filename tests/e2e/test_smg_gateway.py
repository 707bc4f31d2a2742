"""The Shepherd Model Gateway (`smg`, the real gateway from PyPI) in front of radixserve's gRPC
workers (SMG's SGLang worker protocol), with the real openai client through SMG's HTTP port:
the answers radixserve gives on its own HTTP API, streaming, `n`, structured output, and
cache-aware routing that keeps each shared prefix on the worker that holds it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import redis
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.conftest import free_port
from tests.e2e.stack import Stack, start_stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "tiny-llama-11"  # both stacks serve tiny_model_dir, named after its directory
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there, gateway"}]


@dataclass
class Smg:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def get(self, path: str) -> dict[str, Any] | None:
        """GET path's JSON body (also of a 503: /readiness explains itself); None while SMG
        does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                body: dict[str, Any] = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        except OSError:
            return None
        return body

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"smg did not stop on SIGTERM\n{self.log_tail()}") from None


def start_smg(
    workers: list[Stack], log_path: Path, *extra: str, timeout: float = 120.0, http: bool = False
) -> Smg:
    """`smg launch` routing to `workers` over gRPC (or, with `http`, to their HTTP APIs), once
    /readiness counts them all healthy (SMG holds it until it has each worker's tokenizer,
    here from GetTokenizer) and, if there are several, SMG holds a GetLoads answer from each."""
    urls = [w.base_url if http else f"grpc://{w.grpc_target}" for w in workers]
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes it for its lifetime
    cmd = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *urls, "--policy", "cache_aware"]
    # Its own metrics port (the default 29000 may be taken); a short grace period so SIGTERM
    # frees the ports at once; registration retried every second rather than every 30.
    cmd += ["--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1"]
    cmd += ["--worker-startup-check-interval", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    smg = Smg(port, proc, log_path)
    deadline = time.monotonic() + timeout
    ready: dict[str, Any] | None = None
    loads: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"smg exited with {proc.returncode}\n{smg.log_tail()}")
        ready = smg.get("/readiness")
        if ready and ready.get("status") == "ready" and ready["healthy_workers"] == len(urls):
            # With several workers, wait for their loads too. The load monitor polls GetLoads
            # every 10 s, from when the first worker joined; until a worker has answered once,
            # SMG scores it by its live in-flight count, and two idle workers tie (broken at
            # random) however many requests one was just sent.
            loads = smg.get("/get_loads") if len(urls) > 1 else None
            polled = sorted(x["worker"] for x in (loads or {}).get("loads", []))
            if len(urls) == 1 or polled == sorted(urls):
                return smg
        time.sleep(0.2)
    smg.stop()
    raise AssertionError(f"smg not ready in {timeout}s: {ready} {loads}\n{smg.log_tail()}")


def stop_smg(smg: Smg) -> None:
    code = smg.stop()
    assert code == 0, f"smg exited with {code} on SIGTERM\n{smg.log_tail()}"


@pytest.fixture(scope="module")
def smg_one(tiny_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Smg]:
    smg = start_smg([tiny_stack], tmp_path_factory.mktemp("smg") / "smg-one.log")
    yield smg
    stop_smg(smg)


def direct(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)


def greedy_chat(
    client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int
) -> ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_chat_through_smg_answers_what_radixserve_answers(tiny_stack: Stack, smg_one: Smg) -> None:
    want = greedy_chat(direct(tiny_stack), HELLO, 12)
    client = smg_one.client()
    assert [m.id for m in client.models.list()] == [MODEL]  # GetModelInfo's served name
    got = greedy_chat(client, HELLO, 12)
    assert got.model == MODEL
    (choice,) = got.choices
    # SMG detokenizes the worker's ids itself, incrementally as SGLang does: it holds back text
    # that ends in U+FFFD (maybe a character cut in two) and does not flush it at the end.
    # The random model's bytes are mostly not UTF-8, so its trailing U+FFFDs are missing.
    content = want.choices[0].message.content
    assert content is not None and choice.message.content == content.rstrip("\ufffd")
    assert choice.finish_reason == want.choices[0].finish_reason
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    tiny_stack.wait_idle()


def test_streamed_chat_through_smg_adds_up_to_the_whole(tiny_stack: Stack, smg_one: Smg) -> None:
    client = smg_one.client()
    whole = greedy_chat(client, HELLO, 12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == (
        whole.choices[0].message.content
    )
    finishes = [c.choices[0].finish_reason for c in with_choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1)
    assert finishes[-1] == whole.choices[0].finish_reason
    # include_usage: a last chunk without choices carries the usage
    assert not chunks[-1].choices and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    tiny_stack.wait_idle()


def test_n_samples_through_smg(tiny_stack: Stack, smg_one: Smg) -> None:
    got = smg_one.client().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0.8, seed=5, n=3
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in got.choices), got
    # three samples, not one thrice (SMG sends no seed: each is drawn afresh)
    assert len({c.message.content for c in got.choices}) > 1, got
    assert got.usage is not None and 3 <= got.usage.completion_tokens <= 36
    if all(c.finish_reason == "length" for c in got.choices):
        assert got.usage.completion_tokens == 36
    tiny_stack.wait_idle()


def test_json_schema_through_smg_is_radixserves_structured_output(
    tiny_stack: Stack, smg_one: Smg
) -> None:
    def ask(client: openai.OpenAI) -> ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=40,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            },
        )

    got, want = ask(smg_one.client()), ask(direct(tiny_stack))
    content = got.choices[0].message.content
    assert content is not None and got.choices[0].finish_reason == "stop", got
    jsonschema.validate(json.loads(content), SCHEMA)
    # ASCII by construction, so here the text is exactly radixserve's own
    assert content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert got.usage.completion_tokens == want.usage.completion_tokens
    tiny_stack.wait_idle()


# --- two workers: cache-aware routing ----------------------------------------------------------


@pytest.fixture(scope="module")
def second_stack(
    redis_url: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A second worker like tiny_stack (same model, so the same served name) on its own
    Redis database: a separate radixserve, with its own prefix cache."""
    url = redis_url.rsplit("/", 1)[0] + "/4"
    with redis.Redis.from_url(url) as r:
        r.flushdb()
    stack = start_stack(
        ["--model", str(tiny_model_dir), "--max-total-tokens", "8192", "--check-integrity"],
        tmp_path_factory.mktemp("logs") / "second-stack.log",
        url,
        grpc=True,
    )
    yield stack
    code = stack.stop()
    assert code == 0, f"serve exited with {code} on Ctrl-C\n{stack.log_tail()}"
    assert "Traceback" not in stack.log_path.read_text(errors="replace"), stack.log_tail(200)


@pytest.fixture(scope="module")
def smg_two(
    tiny_stack: Stack, second_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Smg]:
    # With two workers one's load never exceeds twice the mean: a relative spill threshold of
    # 10 turns spilling off, so a prefix stays on its worker however the loads stand.
    smg = start_smg(
        [tiny_stack, second_stack],
        tmp_path_factory.mktemp("smg") / "smg-two.log",
        "--balance-rel-threshold",
        "10",
    )
    yield smg
    stop_smg(smg)


# Two long system prompts, distinct from their first words on (~700 tokens each: the tiny
# tokenizer is byte-level), so SMG's token tree matches most of a prompt to the worker that
# served its prefix before.
PREFIXES = {
    "amber": "You keep the lighthouse on the amber coast. "
    + " ".join(f"amber-{i} tide" for i in range(50)),
    "cobalt": "You brew tea in the cobalt mountains. "
    + " ".join(f"cobalt-{i} leaf" for i in range(50)),
}


def prefixed_chat(client: openai.OpenAI, prefix: str, question: str) -> tuple[int, int]:
    """(prompt tokens, of which cached) of a short greedy chat under a system prompt."""
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": prefix}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
    )
    assert got.usage is not None and got.usage.prompt_tokens_details is not None, got
    return got.usage.prompt_tokens, got.usage.prompt_tokens_details.cached_tokens or 0


def test_cache_aware_routing_keeps_each_prefix_on_the_worker_holding_it(
    tiny_stack: Stack, second_stack: Stack, smg_two: Smg
) -> None:
    client = smg_two.client()
    # Sequential, the prefixes taking turns: each first request is a miss everywhere (SMG's
    # tree and both caches); every later one must land where its prefix is cached, which the
    # worker's usage shows (on the other worker it would be a miss again).
    seen: dict[str, list[tuple[int, int]]] = {name: [] for name in PREFIXES}
    for i in range(8):
        for name, prefix in PREFIXES.items():
            seen[name].append(prefixed_chat(client, prefix, f"question number {i}?"))
    with ThreadPoolExecutor(8) as pool:
        later = {
            (name, i): pool.submit(prefixed_chat, client, prefix, f"all at once {i}?")
            for i in range(4)
            for name, prefix in PREFIXES.items()
        }
        for (name, _), done in later.items():
            seen[name].append(done.result())
    for name, usages in seen.items():
        (prompt, cached), *rest = usages
        assert cached < 0.1 * prompt, (name, usages)
        assert all(c >= 0.9 * p for p, c in rest), (name, usages)

    # Where each prefix is, asked of each worker directly: on exactly one (nothing spilled).
    def holds(stack: Stack, prefix: str, question: str = "where is it cached?") -> bool:
        prompt, cached = prefixed_chat(direct(stack), prefix, question)
        return cached >= 0.9 * prompt

    stacks = (tiny_stack, second_stack)
    for name, prefix in PREFIXES.items():
        assert sum(holds(s, prefix) for s in stacks) == 1, name
    # Requests sharing nothing go to the worker whose tree is smaller (SMG's rule below its
    # cache threshold). Each is longer than both prefixes above together, so whichever worker
    # holds them (SMG's tie-break may have put both on one), the first unrelated prompt makes
    # its worker's tree the larger and the next goes to the other: they land on both.
    unrelated = [f"Topic {k} alone. " + " ".join(f"w{k}-{j}" for j in range(360)) for k in range(2)]
    with ThreadPoolExecutor(2) as pool:  # two: what both pools hold beside the prefixes
        list(pool.map(lambda text: prefixed_chat(client, text, "and?"), unrelated))
    where = [[holds(s, text, "and?") for s in stacks] for text in unrelated]
    assert all(sum(w) == 1 for w in where), where
    assert {w.index(True) for w in where} == {0, 1}, where
    tiny_stack.wait_idle()
    second_stack.wait_idle()


def test_smgs_http_mode_routes_radixserves_own_api(tiny_stack: Stack, tmp_path: Path) -> None:
    """SMG in front of radixserve's HTTP API rather than its gRPC workers: it forwards
    /generate with fields of its own (a model named "unknown" among them) and chat as sent,
    and balances by the loads it polls from radixserve's /v1/loads."""
    smg = start_smg([tiny_stack], tmp_path / "smg-http.log", http=True)
    try:
        body = {"text": "the thin", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}

        def generate(base: str) -> dict[str, Any]:
            req = urllib.request.Request(
                f"{base}/generate",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                answer: dict[str, Any] = json.loads(r.read())
            return answer

        routed = generate(f"http://127.0.0.1:{smg.port}")
        assert routed["output_ids"] == generate(tiny_stack.base_url)["output_ids"]
        chat = greedy_chat(smg.client(), HELLO, 8)
        assert (
            chat.choices[0].message == greedy_chat(direct(tiny_stack), HELLO, 8).choices[0].message
        )
        with urllib.request.urlopen(f"{tiny_stack.base_url}/get_server_info") as r:
            (executor,) = json.loads(r.read())["executors"]

        def polled() -> bool:  # SMG's load monitor asks every 10 s
            loads = (smg.get("/get_loads") or {}).get("loads", [])
            return any(x.get("max_total_num_tokens") == executor["total_kv_tokens"] for x in loads)

        deadline = time.monotonic() + 60
        while not polled():
            assert time.monotonic() < deadline, smg.get("/get_loads")
            time.sleep(0.5)
    finally:
        stop_smg(smg)
