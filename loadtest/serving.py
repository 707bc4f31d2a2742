"""`python -m loadtest.serving`: benchmark a running server, flags named as in SGLang's
bench_serving where they overlap.

    python -m loadtest.serving --base-url http://127.0.0.1:8000 --backend radixserve \
        --tokenizer default --dataset-name random --num-prompts 200 --request-rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from loadtest import datasets, report, tokenizer
from loadtest.backends import BACKENDS, Options
from loadtest.datasets import Conversation
from loadtest.flags import build_parser
from loadtest.grpc_backends import GRPC_BACKENDS
from loadtest.metrics import Metrics, compute
from loadtest.progress import Progress
from loadtest.runner import Client, arrival_times, run
from loadtest.textgen import TextSource

WARMUP_OUTPUT_LEN = 16


def build_dataset(
    args: argparse.Namespace, source: TextSource, rng: random.Random
) -> list[Conversation]:
    builders: dict[str, Callable[[], list[Conversation]]] = {
        "random": lambda: datasets.random_dataset(
            source, rng, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio,
        ),
        "generated-shared-prefix": lambda: datasets.shared_prefix_dataset(
            source, rng, args.gsp_num_groups, args.gsp_prompts_per_group,
            args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
        ),
        "multi-turn": lambda: datasets.multi_turn_dataset(
            source, args.multi_turn_num_conversations, args.multi_turn_num_turns,
            args.multi_turn_input_len, args.multi_turn_output_len,
        ),
        "json": lambda: datasets.json_dataset(
            source, rng, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio,
        ),
        "jsonl": lambda: datasets.jsonl_dataset(
            Path(args.dataset_path), source, args.num_prompts, args.jsonl_output_len
        ),
    }  # fmt: skip
    if args.dataset_name == "jsonl" and not args.dataset_path:
        raise SystemExit("--dataset-name jsonl needs --dataset-path")
    conversations = builders[args.dataset_name]()
    if not conversations:
        raise SystemExit("the dataset is empty: check --num-prompts")
    return conversations


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The first model id of GET /v1/models, or None when the server has no such endpoint."""
    try:
        async with session.get(f"{base_url}/v1/models") as resp:
            if resp.status != 200:
                return None
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, ValueError):
        return None
    return str(data[0]["id"]) if data else None


async def resolve_tokenizer(
    args: argparse.Namespace, session: aiohttp.ClientSession, base_url: str
) -> str:
    if args.tokenizer:
        return str(args.tokenizer)
    path = await tokenizer.from_server(session, base_url)
    if path is None:
        raise SystemExit(
            "the server does not say its tokenizer (no GET /get_model_info): pass --tokenizer "
            "(an HF directory, a .gguf file, or 'default' for radixserve's default model)"
        )
    return path


async def warmup(client: Client, source: TextSource, n: int, input_len: int) -> None:
    """n requests of fresh text (nothing the benchmark will send, so no cache is warmed for
    it), all at once; aborts when every one fails, as the benchmark would too."""
    warm = [datasets.single(source, input_len, WARMUP_OUTPUT_LEN) for _ in range(n)]
    done = await run(client, warm, [0.0] * n)
    failed = [r for r in done.results if not r.ok]
    print(f"warmup: {n - len(failed)}/{n} requests ok", file=sys.stderr)
    if len(failed) == n:
        raise SystemExit(f"every warmup request failed; the first error: {failed[0].error}")


async def benchmark(args: argparse.Namespace) -> Metrics:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.plot_dir is not None:
        report.pyplot()  # fail before the run, not after it
    connector = aiohttp.TCPConnector(limit=0)  # the default 100 would cap concurrency silently
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    grpc_backend = args.backend in GRPC_BACKENDS
    if grpc_backend and not args.grpc_target:
        raise SystemExit(f"--backend {args.backend} needs --grpc-target host:port")
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth) as session,
        grpc_channel(args.grpc_target if grpc_backend else None, args.api_key) as channel,
    ):
        model = args.model or await served_model(session, base_url)
        if model is None and args.backend in ("openai", "openai-chat"):
            raise SystemExit(f"{base_url}/v1/models names no model: pass --model")
        tok = tokenizer.load(await resolve_tokenizer(args, session, base_url))
        source = TextSource(tok, args.seed)
        conversations = build_dataset(args, source, random.Random(args.seed))
        options = Options(
            model=model or "",
            temperature=args.temperature,
            ignore_eos=not args.disable_ignore_eos,
            extra_body=args.extra_request_body,
            hop_latency=args.hop_latency,
        )
        backend = GRPC_BACKENDS[args.backend](tok) if grpc_backend else BACKENDS[args.backend]()
        client = Client(
            session,
            base_url + backend.path,
            backend,
            options,
            args.max_concurrency,
            source.count,
            channel,
        )
        if args.warmup_requests > 0:
            first = conversations[0]
            first_len = first.system_len + first.history_len + first.turns[0].user_len
            warm_source = TextSource(tok, args.seed + 1)
            await warmup(client, warm_source, args.warmup_requests, first_len)
        total = sum(len(c.turns) for c in conversations)
        progress = Progress(total, enabled=not args.disable_tqdm)
        arrivals = arrival_times(len(conversations), args.request_rate, args.seed)
        done = await run(client, conversations, arrivals, progress)

    metrics = compute(done.results, done.duration_s, source.count)
    config = {**vars(args), "base_url": base_url, "model": model}
    config.pop("api_key", None)  # a secret: never in the printed or appended report
    print(report.summary(metrics, config))
    if args.output_file is not None:
        report.append_jsonl(Path(args.output_file), metrics, config)
    if args.plot_dir is not None:
        paths = report.plot(
            Path(args.plot_dir), done.results, done.started, done.duration_s, source.count
        )
        print("plots: " + ", ".join(map(str, paths)))
    return metrics


@contextlib.asynccontextmanager
async def grpc_channel(target: str | None, api_key: str | None) -> AsyncIterator[Any]:
    """One channel every request shares (None without a target)."""
    if target is None:
        yield None
        return
    options = [("grpc.max_receive_message_length", 64 << 20)]
    interceptors = [BearerKey(api_key)] if api_key else None
    channel = grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    try:
        yield channel
    finally:
        await channel.close()


class BearerKey(grpc.aio.UnaryStreamClientInterceptor):
    """`authorization: Bearer <key>` on every streaming call, as HTTP's header."""

    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        details = details._replace(metadata=(*(details.metadata or ()), *self.metadata))
        return await continuation(details, request)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(benchmark(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
