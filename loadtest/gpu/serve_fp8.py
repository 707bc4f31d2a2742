"""The `serve_fp8`, `serve_int4` and `serve_gguf` sections: quantized weights through
`radixserve serve`, as a user meets them, on the GPU.

`radixserve serve --quantization fp8 --kv-cache-dtype fp8_e4m3` runs Llama-3.1-8B's shapes
with dummy weights (the word tokenizer, so every sampled id decodes), so decode's products
take kernels/fp8_gemv_packed.py at one to four rows and the fp8 GEMMs past that. `serve_int4`
serves the same shapes as an AWQ checkpoint (config.json's quantization_config; dummy int4
weights), whose decode batches run the int4 MMA (kernels/w4a16_mma.py) and prefill its
expansion for cuBLAS; `serve_gguf` as GGUF Q4_K blocks, converted at load for the same MMA
(services/executor/quant/gguf_linear.py). Then, for each:

- the openai client: each prompt plain (its prefix then cached), then plain again and
  streamed, greedy, 48 tokens with EOS ignored, one request at a time; the streamed text must
  equal the second plain one (the same cached prefix and row counts, so the same launches),
  and usage and finish_reason must say what was asked;
- recorded, not required: how many first answers (the whole prompt prefilled) equal the
  second (the prompt's cached prefix reused), and how many answers of the prompts sent
  together (decode batches of several rows) equal their one-at-a-time twins. Other launches
  round differently, and dummy weights give near-flat logits, so flips are expected there;
- the 2,000-request burst without and with retries (`loadtest.gpu.burst`): nothing lost.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loadtest.gpu.burst import burst_2000, serving_words

MAX_TOKENS = 48
PROMPTS = [
    "The quiet river runs past the old mill",
    "Anna reads a long letter in the morning",
    "A bright lamp stands near the open window",
    "The tired dog sleeps under the wooden table",
    "Every evening the farmer walks to the village",
    "The small boat drifts slowly across the lake",
    "A cold wind blows over the empty field",
    "The teacher writes a short note on the board",
]


def _completion(client: Any, model: str, prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = dict(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        r = client.completions.create(**body)
        return {
            "text": r.choices[0].text,
            "finish_reason": r.choices[0].finish_reason,
            "completion_tokens": r.usage.completion_tokens,
        }
    chunks = client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    text, finish, tokens = [], None, None
    for c in chunks:
        for choice in c.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
        if c.usage is not None:
            tokens = c.usage.completion_tokens
    return {"text": "".join(text), "finish_reason": finish, "completion_tokens": tokens}


def _openai_checks(port: int, label: str) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    cold = [_completion(client, model, p, stream=False) for p in PROMPTS]
    alone = [_completion(client, model, p, stream=False) for p in PROMPTS]
    streamed = [_completion(client, model, p, stream=True) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _completion(client, model, p, False), PROMPTS))
    problems = []
    for i, (c, a, s, t) in enumerate(zip(cold, alone, streamed, together, strict=True)):
        for name, r in (("cold", c), ("plain", a), ("streamed", s), ("together", t)):
            if r["finish_reason"] != "length" or r["completion_tokens"] != MAX_TOKENS:
                got = f"{r['finish_reason']}, {r['completion_tokens']} tokens"
                problems.append(f"prompt {i} {name}: {got}")
        if s["text"] != a["text"]:
            problems.append(f"prompt {i}: streamed text differs from the plain one")

    def same(xs: list[dict[str, Any]], ys: list[dict[str, Any]]) -> int:
        return sum(x["text"] == y["text"] for x, y in zip(xs, ys, strict=True))

    out = {
        "model": model,
        "prompts": len(PROMPTS),
        "streamed_equals_plain": same(streamed, alone),
        "cached_equals_cold": same(alone, cold),
        "together_equals_alone": same(together, alone),
        "problems": problems,
        "first_text": alone[0]["text"][:200],
    }
    print(
        f"openai client, {label}: {out['streamed_equals_plain']}/{len(PROMPTS)} streamed = plain, "
        f"{out['cached_equals_cold']}/{len(PROMPTS)} cached prefix = cold, "
        f"{out['together_equals_alone']}/{len(PROMPTS)} together = alone, "
        f"{len(problems)} problems {problems[:3]}",
        flush=True,
    )
    return out


def serve_fp8_section(log_dir: str) -> dict[str, Any]:
    port = 18120
    flags = ("--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3")
    with serving_words(Path(log_dir) / "serve_fp8.log", port, *flags):
        return {
            "flags": list(flags),
            "openai": _openai_checks(port, "fp8"),
            "burst_2000": burst_2000(port, retry=False),
            "burst_2000_retry": burst_2000(port, retry=True),
        }


def _serve_checkpoint(log_dir: str, name: str, port: int, fmt: str, label: str) -> dict[str, Any]:
    """A quantized checkpoint's dummy weights (config.json's quantization_config from
    loadtest.gpu.quant's FORMATS) through `radixserve serve`: the openai checks and bursts."""
    from loadtest.gpu.quant import FORMATS

    config = {"quantization_config": FORMATS[fmt].quantization_config}
    with serving_words(Path(log_dir) / f"{name}.log", port, config=config):
        return {
            "config": config,
            "openai": _openai_checks(port, label),
            "burst_2000": burst_2000(port, retry=False),
            "burst_2000_retry": burst_2000(port, retry=True),
        }


def serve_int4_section(log_dir: str) -> dict[str, Any]:
    return _serve_checkpoint(log_dir, "serve_int4", 18121, "int4_awq", "int4 AWQ")


def serve_gguf_section(log_dir: str) -> dict[str, Any]:
    return _serve_checkpoint(log_dir, "serve_gguf", 18122, "gguf_q4_k", "GGUF Q4_K")
