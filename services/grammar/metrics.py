"""The grammar service's metrics: requests by result (read from its statistics at scrape
time) and compile time by constraint kind."""

from __future__ import annotations

from services.grammar.core import GrammarStats
from shared.messages.grammar import CompiledGrammarEntry, GrammarCacheEntry
from shared.metrics.buckets import SERVICE_SECONDS
from shared.metrics.registry import ServiceMetrics


class GrammarMetrics:
    def __init__(self, m: ServiceMetrics, stats: GrammarStats) -> None:
        m.counter_function(
            "radixserve:grammar_requests_total",
            "Constrained requests by result: found in the cache (or being compiled by another "
            "request), compiled here, or refused by the compiler",
            lambda: {
                ("cache_hit",): stats.cache_hits,
                ("compiled",): stats.compiled,
                ("invalid",): stats.compile_errors,
            },
            ["result"],
        )
        self.compile_seconds = m.histogram(
            "radixserve:grammar_compile_seconds",
            "Time to compile one grammar, by constraint kind",
            SERVICE_SECONDS,
            ["kind"],
        )

    def compiled(self, result: GrammarCacheEntry) -> None:
        if isinstance(result, CompiledGrammarEntry):
            self.compile_seconds.labels(result.kind).observe(result.compile_ms / 1000.0)
