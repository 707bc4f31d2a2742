"""`python -m loadtest.serving` end to end against the fake server: the metrics agree with what
it served (its delays, its reported usage, its errors)."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from loadtest.flags import build_parser
from loadtest.metrics import Metrics
from loadtest.serving import benchmark
from tests.loadtest.fake_server import MODEL, FakeServer, Script

StartFake = Callable[[Script], Awaitable[FakeServer]]
N = 8


async def bench(fake: FakeServer, tokenizer: Path, *flags: str) -> Metrics:
    argv = ["--base-url", fake.url, "--tokenizer", str(tokenizer), "--disable-tqdm"]
    argv += ["--num-prompts", str(N), "--random-input-len", "32", "--random-output-len", "5"]
    return await benchmark(build_parser().parse_args([*argv, *flags]))


@pytest.mark.parametrize("backend", ["radixserve", "openai", "openai-chat"])
async def test_metrics_agree_with_what_the_server_served(
    backend: str,
    start_fake: StartFake,
    bpe_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = Script()  # 5 chunks: the first after 50 ms, then every 20 ms
    fake = await start_fake(script)
    out = tmp_path / "runs.jsonl"
    m = await bench(fake, bpe_path, "--backend", backend, "--output-file", str(out))

    assert len(fake.served) == 1 + N  # the warmup request, then the benchmark
    assert (m.completed, m.failed, m.errors) == (N, 0, [])
    assert m.total_output_tokens == N * script.completion_tokens
    assert m.total_input_tokens == N * script.prompt_tokens
    assert m.token_counts == "server usage"
    assert m.cache_hit_rate == pytest.approx(0.4)
    assert m.ttft is not None and m.itl is not None and m.tpot is not None and m.e2e is not None
    # The fake's sleeps are lower bounds: each figure at least its scripted delay, in
    # milliseconds. The upper bounds catch a unit slip (seconds or microseconds read as
    # milliseconds: 1,000 times off), not slowness: the fake shares the client's event loop
    # in a pytest worker, where one stall (a busy 2-core machine; once every request's first
    # token at 1.01 s against a scripted 50 ms) stretches every figure together.
    assert 50 <= m.ttft.mean < 20_000
    assert 19 <= m.itl.median < 10_000
    assert 19 <= m.tpot.mean < 10_000  # (e2e - ttft) / 4: the gaps
    assert m.e2e.mean == pytest.approx(m.ttft.mean + 4 * m.tpot.mean)
    assert 130 <= m.e2e.mean < 60_000
    assert m.output_throughput == pytest.approx(m.total_output_tokens / m.duration_s)
    assert m.request_throughput == pytest.approx(N / m.duration_s)
    if backend != "radixserve":
        assert {s.body["model"] for s in fake.served} == {MODEL}  # from GET /v1/models

    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "40.0%" in printed
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["config"]["backend"] == backend and record["config"]["request_rate"] == "inf"
    assert record["completed"] == N and record["cache_hit_rate"] == pytest.approx(0.4)
    assert record["mean_ttft_ms"] == pytest.approx(m.ttft.mean)


async def test_the_api_key_is_sent_and_kept_out_of_the_report(
    start_fake: StartFake, bpe_path: Path, tmp_path: Path
) -> None:
    fake = await start_fake(Script())
    out = tmp_path / "runs.jsonl"
    await bench(fake, bpe_path, "--api-key", "s3cret-key", "--output-file", str(out))
    assert {s.authorization for s in fake.served} == {"Bearer s3cret-key"}
    assert "s3cret-key" not in out.read_text()


async def test_without_usage_output_tokens_are_re_tokenized(
    start_fake: StartFake, bpe_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer

    script = Script(report_usage=False)
    fake = await start_fake(script)
    m = await bench(fake, bpe_path, "--backend", "openai")
    answer = "".join(script.chunks)
    per_answer = len(Tokenizer.from_file(str(bpe_path)).encode(answer).ids)
    assert m.total_output_tokens == N * per_answer
    assert m.token_counts == "client tokenizer"
    assert m.cache_hit_rate is None
    assert "n/a" in capsys.readouterr().out


async def test_http_errors_are_counted_and_shown(
    start_fake: StartFake, bpe_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = await start_fake(Script(fail_status=400))
    m = await bench(fake, bpe_path, "--backend", "openai-chat", "--warmup-requests", "0")
    assert (m.completed, m.failed) == (0, N)
    assert len(m.errors) == 5 and all(e.startswith("HTTP 400:") for e in m.errors)
    assert m.ttft is None
    printed = capsys.readouterr().out
    assert "First 5 errors:" in printed and "scripted failure" in printed


async def test_an_error_event_mid_stream_fails_the_request(
    start_fake: StartFake, bpe_path: Path
) -> None:
    fake = await start_fake(Script(error_after_first=True))
    m = await bench(fake, bpe_path, "--backend", "openai", "--warmup-requests", "0")
    assert (m.completed, m.failed) == (0, N)
    assert m.errors[0] == "scripted mid-stream failure"


@pytest.mark.parametrize("backend", ["radixserve", "openai-chat"])
async def test_json_dataset_sends_schemas_and_counts_the_400s(
    backend: str, start_fake: StartFake, bpe_path: Path
) -> None:
    fake = await start_fake(Script(reject_response_format=True))
    m = await bench(fake, bpe_path, "--backend", backend, "--dataset-name", "json")
    assert (m.completed, m.failed) == (0, N)  # the warmup has no schema and passed
    assert all("not supported" in e for e in m.errors)
    bodies = [s.body for s in fake.served[1:]]
    if backend == "radixserve":
        assert all("json_schema" in b["sampling_params"] for b in bodies)
    else:
        assert all(b["response_format"]["type"] == "json_schema" for b in bodies)


async def test_warmup_failing_entirely_aborts(start_fake: StartFake, bpe_path: Path) -> None:
    fake = await start_fake(Script(fail_status=503))
    with pytest.raises(SystemExit, match="every warmup request failed"):
        await bench(fake, bpe_path, "--warmup-requests", "2")
    assert len(fake.served) == 2


async def test_tokenizer_is_required_when_the_server_does_not_say(start_fake: StartFake) -> None:
    fake = await start_fake(Script())
    args = build_parser().parse_args(["--base-url", fake.url])
    with pytest.raises(SystemExit, match="pass --tokenizer"):
        await benchmark(args)


async def test_plots(start_fake: StartFake, bpe_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    fake = await start_fake(Script(first_delay=0.01, gap=0.005))
    await bench(fake, bpe_path, "--plot-dir", str(tmp_path / "plots"), "--request-rate", "50")
    for name in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_plots_without_matplotlib_fail_before_the_run(
    start_fake: StartFake, bpe_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    fake = await start_fake(Script())
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        await bench(fake, bpe_path, "--plot-dir", str(tmp_path))
    assert fake.served == []
