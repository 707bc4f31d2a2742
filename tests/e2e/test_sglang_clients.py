"""What SGLang's own clients send, through every service of the tiny stack: its benchmark
(`python -m sglang.bench_serving`, unmodified) on each of its request paths, and the fields of
SGLang's OpenAI dialect through the `openai` client's extra_body (regex, ebnf, json_schema,
stop_regex, no_stop_trim, rid, continue_final_message, max_tokens 0 with echo); and vLLM's
names for structured output and kept stop strings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.stack import Stack

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "tiny-llama-11"
PROMPTS = 6

BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
# bench_serving imports Hugging Face `datasets` for its dataset loaders; the random-ids
# dataset used here never calls it, and the package is not among radixserve's.
DATASETS_STUB = (
    "def load_dataset(*args, **kwargs):\n"
    "    raise RuntimeError('the tests run bench_serving on random-ids only')\n"
)
# `python -m sglang.bench_serving` once per backend, in one interpreter: each run executes
# the unmodified module as its own __main__ (runpy), and only the imports it shares with the
# others (torch and transformers: about 10 s of CPU a process) are done once. A run that
# exits nonzero stops the driver with that status. Its argument: each run's argv, in JSON.
DRIVER = (
    "import json, runpy, sys\n"
    "for argv in json.loads(sys.argv[1]):\n"
    "    sys.argv = ['bench_serving', *argv]\n"
    "    try:\n"
    "        runpy.run_module('sglang.bench_serving', run_name='__main__', alter_sys=True)\n"
    "    except SystemExit as e:\n"
    "        if e.code not in (None, 0):\n"
    "            raise\n"
)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def bench_results(
    tiny_stack: Stack, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    """Each backend's bench_serving result lines."""
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "datasets").mkdir()
    (tmp / "datasets" / "__init__.py").write_text(DATASETS_STUB)
    path = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    runs: list[list[str]] = []
    for backend in BACKENDS:
        args = ["--backend", backend, "--base-url", tiny_stack.base_url]
        args += ["--tokenizer", str(tiny_model_dir), "--dataset-name", "random-ids"]
        args += ["--num-prompts", str(PROMPTS), "--random-input-len", "24"]
        args += ["--random-output-len", "6", "--seed", "3"]
        args += ["--output-file", str(tmp / f"{backend}.jsonl"), "--disable-tqdm"]
        runs.append(args)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        b: [json.loads(line) for line in (tmp / f"{b}.jsonl").read_text().splitlines()]
        for b in BACKENDS
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_bench_serving_completes_every_request(
    bench_results: dict[str, list[dict[str, Any]]], backend: str
) -> None:
    """Its /generate bodies carry `"lora_path": null`, and its random output lengths include
    0 (max_tokens 0 on the OpenAI paths): both were 400s, which failed its warm-up."""
    (result,) = bench_results[backend]
    assert result["backend"] == backend, result
    assert result["completed"] == PROMPTS, result
    assert result["total_output_tokens"] > 0


def test_sglang_constraint_and_stop_fields_through_the_openai_client(tiny_stack: Stack) -> None:
    c = client(tiny_stack)
    messages: list[Any] = [{"role": "user", "content": "the thin"}]
    digits = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, extra_body={"regex": "[0-9]{4}"}
    )
    assert digits.choices[0].message.content is not None
    assert len(digits.choices[0].message.content) == 4
    assert digits.choices[0].message.content.isdigit()
    yes_no = c.completions.create(
        model=MODEL, prompt="the", max_tokens=4, extra_body={"ebnf": 'root ::= "yes" | "no"'}
    )
    assert yes_no.choices[0].text in ("yes", "no")
    flag = c.completions.create(
        model=MODEL, prompt="the", max_tokens=8, extra_body={"json_schema": '{"type": "boolean"}'}
    )
    assert json.loads(flag.choices[0].text) in (True, False)

    full = greedy(c)
    stop = full[5:7]  # two characters from inside the output: the first match of them ends it
    cut = full.index(stop)
    assert greedy(c, stop=[stop]) == full[:cut]
    assert greedy(c, stop=[stop], no_stop_trim=True) == full[: cut + len(stop)]
    regex = "".join(f"[{ch}]" if ch.strip() else r"\s" for ch in stop)
    assert greedy(c, stop_regex=regex) == full[: cut + len(stop)]  # a regex match is kept


def greedy(c: openai.OpenAI, stop: list[str] | None = None, **extra: Any) -> str:
    """24 greedy tokens after "the thin" (no EOS), with SGLang's or vLLM's `extra` fields."""
    out = c.completions.create(
        model=MODEL,
        prompt="the thin",
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True, **extra},
    )
    return out.choices[0].text


def test_rid_names_the_request_and_its_samples(tiny_stack: Stack) -> None:
    c = client(tiny_stack)
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a"}],
        max_tokens=2,
        n=2,
        extra_body={"rid": "sglang-client-rid"},
    )
    assert out.id.endswith("sglang-client-rid") and len(out.choices) == 2
    with pytest.raises(openai.BadRequestError, match="not supported: this server serves one"):
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a"}],
            max_tokens=2,
            extra_body={"lora_path": "my-adapter"},
        )


def test_continue_final_message_continues_the_assistant_text(tiny_stack: Stack) -> None:
    """The same greedy tokens as the rendered text sent as a plain prompt: the template left
    the assistant's message open (no end of turn, no new generation prompt)."""
    c = client(tiny_stack)
    messages: list[Any] = [
        {"role": "user", "content": "the thin"},
        {"role": "assistant", "content": "the thing in"},
    ]
    chat = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "ignore_eos": True},
    )
    rendered = "<|im_start|>user\nthe thin<|im_end|>\n<|im_start|>assistant\nthe thing in"
    plain = c.completions.create(
        model=MODEL, prompt=rendered, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == plain.choices[0].text


def test_zero_max_tokens_with_echo_scores_the_prompt(tiny_stack: Stack) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs, nothing new."""
    out = client(tiny_stack).completions.create(
        model=MODEL, prompt="the thin dog", max_tokens=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text == "the thin dog" and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == out.usage.prompt_tokens
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_vllm_structured_output_fields_through_the_openai_client(tiny_stack: Stack) -> None:
    c = client(tiny_stack)
    messages: list[Any] = [{"role": "user", "content": "pick one"}]
    for extra in (
        {"guided_choice": ["alpha", "beta"]},
        {"structured_outputs": {"choice": ["alpha", "beta"]}},
    ):
        out = c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, extra_body=extra
        )
        assert out.choices[0].message.content in ("alpha", "beta")
    digits = c.completions.create(
        model=MODEL,
        prompt="the",
        max_tokens=6,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert len(digits.choices[0].text) == 3 and digits.choices[0].text.isdigit()
    full = greedy(c)
    stop = full[5:7]
    kept = greedy(c, stop=[stop], include_stop_str_in_output=True)
    assert kept == full[: full.index(stop) + len(stop)]
