"""Structured output on the GPU: constrained vs unconstrained throughput at batch 64, the
jump-forward speed-up on a schema with long fixed keys, grammar compile and load times."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xgrammar as xgr

from loadtest import offline
from loadtest.gpu.hosttime import HostTimes
from loadtest.gpu.models import llama8b_dir
from loadtest.gpu.timeline import profile_decode
from services.executor.engine.loop import Engine
from services.executor.grammar.backend import GrammarBackend
from shared.grammar import (
    GrammarTokenizer,
    compile_constraint,
    dump_compiled,
    grammar_key,
    load_compiled,
    new_compiler,
)
from shared.messages.common import JsonSchemaConstraint, SamplingParams, Trace
from shared.messages.schedule import TokenizedRequest
from shared.model_files import resolve_model

BATCH = 64
ROUNDS = 3
MIXED_CONSTRAINED = 8  # of BATCH: requests with long forced keys among free ones
DIGITS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 96,
    "maxItems": 96,
}
LONG_KEYS = {
    "type": "object",
    "properties": {
        f"a_rather_long_property_name_number_{i}": {"type": "integer", "minimum": 0, "maximum": 9}
        for i in range(8)
    },
}
LONG_KEYS["required"] = list(LONG_KEYS["properties"])


def _request(
    rid: str, out: int, key: str = "", schema: str = "", seeded: bool = False
) -> TokenizedRequest:
    """Seeded only where two runs must sample the same tokens (jump-forward against plain
    masking): a seeded request draws from its own generator, one row at a time, which would
    weigh on both sides of the constrained/unconstrained comparison alike."""
    return TokenizedRequest(
        trace=Trace(rid=rid, reply_to="", deadline=time.time() + 3600),
        input_ids=[(7 * int(rid[1:]) + j) % 250 + 3 for j in range(128)],
        sampling=SamplingParams(
            max_new_tokens=out,
            temperature=1.0,
            seed=int(rid[1:]) if seeded else None,
            ignore_eos=not key,
        ),
        max_new_tokens=out,
        eos_token_ids=[],
        detok_stream="bench",
        constraint=JsonSchemaConstraint(schema=schema) if key else None,
        grammar_key=key,
    )


def _digits(key: str, source: str, prefix: str) -> list[TokenizedRequest]:
    return [_request(f"{prefix}{i}", 400, key, source) for i in range(BATCH)]


class Timed(NamedTuple):
    seconds: float
    tokens: int
    steps: int
    overlapped: int  # steps launched before the previous step's tokens reached the host
    host_ms: dict[str, float]  # host time per step by engine phase
    tokens_by_rid: dict[str, int]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def report(self) -> dict[str, Any]:
        return {
            "tok_s": self.tok_s,
            "steps": self.steps,
            "overlapped_share": self.overlapped / max(1, self.steps),
            "host_ms_per_step": self.host_ms,
        }


def _timed(
    engine: Engine, host: HostTimes, reqs: list[TokenizedRequest], jump_forward: bool = True
) -> Timed:
    assert engine.grammars is not None
    engine.grammars.jump_forward = jump_forward
    torch.cuda.synchronize()
    steps0, overlapped0 = engine.step_no, engine.overlapped_steps
    host.start()
    t0 = time.perf_counter()
    d = offline.drain(engine, reqs)
    torch.cuda.synchronize()
    return Timed(
        time.perf_counter() - t0,
        d.tokens,
        engine.step_no - steps0,
        engine.overlapped_steps - overlapped0,
        host.per_step(),
        d.tokens_by_rid,
    )


def structured() -> dict[str, Any]:
    # A full 128K vocabulary, as Llama 3's: xgrammar's per-token costs depend on it.
    model = llama8b_dir(Path(tempfile.mkdtemp()), tokenizer="bpe")
    tok = GrammarTokenizer.load(resolve_model(str(model)))
    compiler = new_compiler(tok)
    compiled: dict[str, xgr.CompiledGrammar] = {}
    out: dict[str, Any] = {}

    def compile_schema(schema: dict[str, Any]) -> tuple[str, str]:
        source = json.dumps(schema)
        c = JsonSchemaConstraint(schema=source)
        key = grammar_key(c, tok.fingerprint)
        t0 = time.perf_counter()
        compiled[key] = compile_constraint(compiler, c)
        first = time.perf_counter() - t0
        data = dump_compiled(compiled[key])
        t0 = time.perf_counter()
        load_compiled(data, tok)
        out.setdefault("compile_ms", {})[schema.get("type", "?") + str(len(source))] = {
            "first_compile_ms": 1000 * first,
            "cached_load_ms": 1000 * (time.perf_counter() - t0),
            "cached_bytes": len(data),
        }
        return key, source

    args = offline.parse_args(["throughput", "--model", str(model), "--load-format", "dummy"])
    grammars = GrammarBackend(tok, compiled.__getitem__)
    engine = offline.make_engine(args, grammars)
    host = HostTimes(engine)
    digits_key, digits_src = compile_schema(DIGITS)
    # Untimed, at the timed batch's shapes: a constrained batch of 64 prompts of 128 tokens
    # plus the forced "[" is chunked differently from any warm-up batch, and compiling those
    # kernel variants inside the timed run cost it a third of its speed on a fresh machine.
    # (The same prompts as the timed runs: every run after the first finds them cached.)
    offline.drain(engine, [_request(f"w{i}", 8, digits_key, digits_src) for i in range(BATCH)])

    # Masking alone (jump-forward off): the same tokens per step as unconstrained decoding.
    # Three rounds, alternating, so a drift of the machine's speed falls on both sides.
    runs: dict[str, list[Timed]] = {
        "constrained": [],
        "unconstrained": [],
        "jump_forward": [],
        "jump_forward_always_extend": [],
    }
    default_min = engine.policy.jump_extend_min
    for _ in range(ROUNDS):
        c = _timed(engine, host, _digits(digits_key, digits_src, "c"), jump_forward=False)
        per_req = c.tokens // BATCH
        # The same requests unconstrained: each as long as its constrained twin came out (the
        # lengths vary with how the digits' separators were tokenized), so that both runs
        # end with the same tail of a shrinking batch.
        u = _timed(
            engine, host, [_request(f"u{i}", c.tokens_by_rid[f"c{i}"]) for i in range(BATCH)]
        )
        # As served by default: jump-forward on.
        cj = _timed(engine, host, _digits(digits_key, digits_src, "k"))
        # Forced text extending every step it appears (jump_extend_min 0), for comparison.
        engine.policy.jump_extend_min = 0.0
        ce = _timed(engine, host, _digits(digits_key, digits_src, "e"))
        engine.policy.jump_extend_min = default_min
        for name, t in zip(runs, (c, u, cj, ce), strict=True):
            runs[name].append(t)
    free = runs["unconstrained"]
    ratios = [a.tok_s / b.tok_s for a, b in zip(runs["constrained"], free, strict=True)]
    jf_ratios = [a.tok_s / b.tok_s for a, b in zip(runs["jump_forward"], free, strict=True)]
    ae = runs["jump_forward_always_extend"]
    ae_ratios = [a.tok_s / b.tok_s for a, b in zip(ae, free, strict=True)]
    out["constrained_vs_unconstrained"] = {
        "batch": BATCH,
        "tokens_per_request": per_req,
        "rounds": ROUNDS,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "ratio_jump_forward_median": statistics.median(jf_ratios),
        "ratios_jump_forward": jf_ratios,
        "jump_extend_min": default_min,
        "ratio_always_extend_median": statistics.median(ae_ratios),
        **{name: [t.report() for t in ts] for name, ts in runs.items()},
    }
    # The device's own timeline over steady decode steps, each side alike.
    grammars.jump_forward = False
    out["timeline"] = {
        "constrained": profile_decode(engine, _digits(digits_key, digits_src, "t"), 8, 32, host),
        "unconstrained": profile_decode(
            engine, [_request(f"v{i}", per_req) for i in range(BATCH)], 8, 32, host
        ),
    }
    grammars.jump_forward = True
    out["timeline"]["constrained_jump_forward"] = profile_decode(
        engine, _digits(digits_key, digits_src, "s"), 8, 32, host
    )
    long_key, long_src = compile_schema(LONG_KEYS)
    # Untimed, as above: the forced keys' EXTEND steps have shapes nothing before them had.
    offline.drain(engine, [_request(f"x{i}", 600, long_key, long_src) for i in range(BATCH)])
    longs = [_request(f"p{i}", 600, long_key, long_src, seeded=True) for i in range(BATCH)]
    p = _timed(engine, host, longs, jump_forward=False)
    longs = [_request(f"j{i}", 600, long_key, long_src, seeded=True) for i in range(BATCH)]
    extended = engine.policy.jump_extended_tokens
    j = _timed(engine, host, longs)
    # Where the policy matters: a few requests with forced text among many free ones.
    mixed: dict[str, Any] = {"constrained": MIXED_CONSTRAINED, "free": BATCH - MIXED_CONSTRAINED}
    for name, minimum in (("default", default_min), ("always_extend", 0.0)):
        engine.policy.jump_extend_min = minimum
        reqs = [_request(f"m{i}", 600, long_key, long_src) for i in range(MIXED_CONSTRAINED)]
        reqs += [_request(f"f{i}", 300) for i in range(MIXED_CONSTRAINED, BATCH)]
        extended = engine.policy.jump_extended_tokens
        t = _timed(engine, host, reqs)
        mixed[name] = {
            **t.report(),
            "jump_extend_min": minimum,
            "jump_extended_tokens": engine.policy.jump_extended_tokens - extended,
        }
    engine.policy.jump_extend_min = default_min
    out["jump_policy_mixed"] = mixed
    out["jump_forward"] = {
        "batch": BATCH,
        "plain_s": p.seconds,
        "jump_s": j.seconds,
        "speedup": p.seconds / j.seconds,
        "plain_steps": p.steps,
        "jump_steps": j.steps,
        "tokens_plain": p.tokens,
        "tokens_jump": j.tokens,
        "jump_extended_tokens": engine.policy.jump_extended_tokens - extended,
        "plain_overlapped_share": p.overlapped / max(1, p.steps),
        "jump_overlapped_share": j.overlapped / max(1, j.steps),
    }
    return out
