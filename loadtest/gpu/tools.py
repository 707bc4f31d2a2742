"""Tool calling with tool_choice "required" against plain chat on the GPU, at batch 64: the
output constrained by the very schema the gateway builds for "required" over the tools
(services/gateway/validation/tools.py), against the same requests unconstrained, each as
long as its constrained twin came out; three rounds, alternating.

Two sets of tools: TYPICAL, schemas as agent frameworks send them (strings, an enum, a bounded
integer, an array), whose free strings let calls run to hundreds of tokens as a coding
agent's do; and BOUNDED, whose string arguments carry minLength/maxLength in the hundreds,
the costliest construct for the mask (a counted repetition, see shared/grammar.py)."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from loadtest import offline
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.structured import BATCH, ROUNDS, _request, _timed
from services.executor.engine.loop import Engine
from services.executor.grammar.backend import GrammarBackend
from services.gateway.validation.tools import ToolPlan, check_tool, tool_constraint
from shared.grammar import GrammarTokenizer, compile_constraint, grammar_key, new_compiler
from shared.messages.common import JsonSchemaConstraint
from shared.model_files import resolve_model

TYPICAL = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
                    "sites": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
]
BOUNDED = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "maxLength": 40},
                    "content": {"type": "string", "minLength": 400, "maxLength": 800},
                },
                "required": ["path", "content"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "minLength": 300, "maxLength": 600}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
]


def tools_section() -> dict[str, Any]:
    model = llama8b_dir(Path(tempfile.mkdtemp()), tokenizer="bpe")
    tok = GrammarTokenizer.load(resolve_model(str(model)))
    compiler = new_compiler(tok)
    compiled: dict[str, Any] = {}
    schemas: dict[str, tuple[str, str]] = {}  # set -> (grammar key, schema)
    for name, tools in (("typical", TYPICAL), ("bounded", BOUNDED)):
        plan = ToolPlan("required", [check_tool(t, "tools") for t in tools], parallel=False)
        constraint = tool_constraint(plan)
        assert isinstance(constraint, JsonSchemaConstraint)
        c = JsonSchemaConstraint(schema=constraint.schema)
        key = grammar_key(c, tok.fingerprint)
        compiled[key] = compile_constraint(compiler, c)
        schemas[name] = (key, constraint.schema)
    args = offline.parse_args(["throughput", "--model", str(model), "--load-format", "dummy"])
    engine = offline.make_engine(args, GrammarBackend(tok, compiled.__getitem__))
    host = HostTimes(engine)
    for key, source in schemas.values():  # warm-up
        offline.drain(engine, [_request(f"w{i}", 8, key, source) for i in range(BATCH)])
    return {name: _required(engine, host, *ks) for name, ks in schemas.items()}


def _required(engine: Engine, host: HostTimes, key: str, source: str) -> dict[str, Any]:
    constrained, plain, ratios, lengths = [], [], [], []
    for r in range(ROUNDS):
        reqs = [_request(f"c{i}", 1024, key, source) for i in range(BATCH)]
        c = _timed(engine, host, reqs)
        twins = [_request(f"u{i}", c.tokens_by_rid[f"c{i}"]) for i in range(BATCH)]
        u = _timed(engine, host, twins)
        constrained.append(c.report())
        plain.append(u.report())
        ratios.append(c.tok_s / u.tok_s)
        lengths.append(c.tokens / BATCH)
        print(f"round {r}: required {c.tok_s:.0f} tok/s, plain {u.tok_s:.0f} tok/s", flush=True)
    return {
        "batch": BATCH,
        "rounds": ROUNDS,
        "schema": json.loads(source),
        "tokens_per_call_mean": lengths,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "required": constrained,
        "plain": plain,
    }
