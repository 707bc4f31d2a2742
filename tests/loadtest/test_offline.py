"""The offline benchmark drives the engine in-process and counts exactly what it asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loadtest import offline
from loadtest.gpu_bench import table
from tests.executor.helpers import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("offline"), "qwen2", seed=1)


def test_throughput_counts_every_requested_token(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    rec = offline.main(
        [
            "throughput",
            "--model",
            str(tiny),
            "--num-prompts",
            "12",
            "--input-len",
            "40",
            "--output-len",
            "9",
            "--range-ratio",
            "0.5",
            "--output-file",
            str(out),
        ]
    )
    assert rec["requests"] == 12
    # ignore_eos: each request generates exactly its drawn output length, all in [4, 9].
    assert 12 * 4 <= rec["output_tokens"] <= 12 * 9
    assert 12 * 20 <= rec["input_tokens"] <= 12 * 40
    assert rec["output_tok_s"] == pytest.approx(rec["output_tokens"] / rec["elapsed_s"])
    assert json.loads(out.read_text().splitlines()[-1])["output_tokens"] == rec["output_tokens"]


def test_dummy_weights_need_only_a_config(tiny: Path, tmp_path: Path) -> None:
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((tiny / "config.json").read_text())
    rec = offline.main(
        [
            "latency",
            "--model",
            str(cfg_only),
            "--load-format",
            "dummy",
            "--batch-size",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "5",
            "--output-file",
            str(tmp_path / "l.jsonl"),
        ]
    )
    assert rec["prefill_steps"] == 1
    assert rec["decode_steps"] == 4  # the first token comes from the prefill
    assert rec["decode_step_ms_mean"] > 0 and rec["finished"] == 3


def test_fp8_kv_cache_option(tiny: Path, tmp_path: Path) -> None:
    """--kv-cache-dtype reaches the engine (gpu_bench's offline_fp8 section runs this way)."""
    args = [
        "throughput",
        "--model",
        str(tiny),
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--num-prompts",
        "4",
        "--input-len",
        "20",
        "--output-len",
        "6",
    ]
    engine = offline.make_engine(offline.parse_args(args))
    assert engine.policy.kv.dtype == torch.float8_e5m2
    rec = offline.main([*args, "--output-file", str(tmp_path / "f.jsonl")])
    assert rec["requests"] == 4 and rec["output_tokens"] == 4 * 6
    assert rec["config"]["kv_cache_dtype"] == "fp8_e5m2"


def test_gpu_bench_table_reports_fp8_beside_bf16() -> None:
    results = {
        "offline": {"output_tok_s": 4000.0, "kv_pool_tokens": 400000},
        "offline_fp8": {"output_tok_s": 5000.0, "kv_pool_tokens": 800000},
    }
    text = table(results)
    assert "offline 500 prompts output tok/s  " in text
    assert "fp8_e5m2 KV  5000 = 1.25x bf16 KV, pool 800000 tokens" in text


def test_fp8_weights_option_and_the_bytes_a_decode_step_reads(tiny: Path) -> None:
    """--quantization reaches the engine (gpu_bench's offline_fp8w and quant_decode run this
    way); quant_decode's roofline counts the fp8 projections at one byte a weight plus their
    per-row fp32 scales, everything else as before."""
    from loadtest.gpu.quant import bytes_per_step

    base = ["latency", "--model", str(tiny), "--max-total-tokens", "256"]
    bf16 = offline.make_engine(offline.parse_args([*base, "--dtype", "bfloat16"]))
    fp8 = offline.make_engine(
        offline.parse_args([*base, "--dtype", "bfloat16", "--quantization", "fp8"])
    )
    model = fp8.runner.model
    assert model.quantization is not None and model.quantization.family == "fp8"
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = (q + 2 * kv) + c.hidden_size + 2 * c.intermediate_size + c.hidden_size
    weights = c.hidden_size * (q + 2 * kv + q + 3 * c.intermediate_size)
    saved = c.num_layers * (weights - 4 * rows)  # 2 bytes -> 1 a weight, + 4 per row's scale
    kv_dtype = bf16.policy.kv.dtype
    assert bytes_per_step(bf16.runner.model, kv_dtype, 10) - saved == bytes_per_step(
        model, kv_dtype, 10
    )


def test_int4_weights_and_the_bytes_a_decode_step_reads(tiny: Path) -> None:
    """quant_decode_int4's configs load (dummy weights, as gpu_bench runs them), and its
    roofline counts the int4 projections at half a byte a weight plus each group's fp16
    scale and uint8 zero point, per output row."""
    import json
    import shutil

    from loadtest.gpu.quant import FORMATS, bytes_per_step

    base = ["latency", "--max-total-tokens", "256", "--dtype", "bfloat16"]
    bf16 = offline.make_engine(offline.parse_args([*base, "--model", str(tiny)]))
    kv_dtype = bf16.policy.kv.dtype
    c = bf16.runner.model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    # (rows, columns) of qkv, o, gate_up, down
    shapes = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q)]
    shapes += [(2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    saved = c.num_layers * sum(n * k * 2 - n * k // 2 - n * -(-k // 128) * 3 for n, k in shapes)
    for name in ("int4_awq", "int4_gptq"):
        path = shutil.copytree(tiny, tiny.parent / name)
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = FORMATS[name].quantization_config
        (path / "config.json").write_text(json.dumps(config))
        args = [*base, "--model", str(path), "--load-format", "dummy"]
        model = offline.make_engine(offline.parse_args(args)).runner.model
        assert model.quantization is not None and model.quantization.family in name
        want = bytes_per_step(bf16.runner.model, kv_dtype, 10) - saved
        assert bytes_per_step(model, kv_dtype, 10) == want


class _ScriptedEngine:
    """Steps of the given kinds ("e" extend, "d" decode, "-" idle), then no more work."""

    def __init__(self, kinds: str) -> None:
        self.kinds = list(kinds)

    def submit(self, _req: object) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.kinds)

    def step(self) -> object:
        kind = self.kinds.pop(0)

        class Result:
            is_decode = kind == "d"
            forward_tokens = 0 if kind == "-" else 4
            outputs: list[object] = []

        return Result()


def test_steady_decode_steps_are_those_after_a_decode_step() -> None:
    """A decode step right after an extend waits, with overlap, for the prefill chunk on the
    device: issue 26's table takes only decode steps that follow a decode step."""
    d = offline.drain(_ScriptedEngine("eddeddd-dde"), [])  # type: ignore[arg-type]
    assert (d.decode_steps, d.extend_steps) == (7, 3)
    assert d.steady_decode_steps == 4  # the 2nd, 4th, 5th and 7th decode steps
    assert 0 <= d.steady_decode_s <= d.decode_s
