"""deploy/grafana: the dashboard is a current Grafana dashboard whose every panel queries the
chosen Prometheus, whose PromQL names only metrics the services export (METRICS below, the
list tests of the live /metrics pages check against), and which shows every one of them;
its provisioning loads it with no clicks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.test_compose import compose

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "radixserve-dashboard.json"

# Every metric the services export, histograms by their base name.
GATEWAY = {
    "sglang:num_requests_total",
    "sglang:num_aborted_requests_total",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds",
    "sglang:time_per_output_token_seconds",
    "radixserve:responses_total",
    "radixserve:first_token_stage_seconds",
    "radixserve:inflight_requests",
}
EXECUTOR = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_used_tokens",
    "sglang:max_total_num_tokens",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:gen_throughput",
    "radixserve:executor_step_seconds",
    "radixserve:executor_forward_tokens_total",
    "radixserve:executor_generated_tokens_total",
    "radixserve:executor_prompt_tokens_total",
    "radixserve:executor_cached_tokens_total",
    "radixserve:executor_retractions_total",
    "radixserve:executor_evicted_tokens_total",
    "radixserve:executor_aborts_total",
    "radixserve:executor_cached_kv_tokens",
}
TOKENIZER = {"radixserve:tokenizer_requests_total", "radixserve:tokenize_seconds"}
GRAMMAR = {"radixserve:grammar_requests_total", "radixserve:grammar_compile_seconds"}
SCHEDULER = {
    "radixserve:scheduler_routed_total",
    "radixserve:scheduler_redispatched_total",
    "radixserve:scheduler_live_executors",
    "radixserve:scheduler_inflight_requests",
    "radixserve:scheduler_refused_total",
}
DETOKENIZER = {
    "radixserve:detokenize_seconds",
    "radixserve:detokenizer_requests",
    "radixserve:detokenizer_finished_total",
}
EVERY_SERVICE = {
    "radixserve:bus_wait_seconds",
    "radixserve:stream_length",
    "radixserve:stream_pending",
}
# prometheus_client's ProcessCollector: no model_name / instance_id labels on these.
PROCESS = {
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_start_time_seconds",
    "process_open_fds",
    "process_max_fds",
}
METRICS = GATEWAY | EXECUTOR | TOKENIZER | GRAMMAR | SCHEDULER | DETOKENIZER | EVERY_SERVICE
KNOWN = METRICS | PROCESS

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without"}
_SELECTOR = re.compile(r"(?<![\w:])((?:sglang|radixserve):\w+)(\{[^{}]*\})?")


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression reads, histogram series by their base name."""
    text = _STRING.sub('""', expr)
    for pattern in (_MATCHERS, _RANGE, _GROUPING):
        text = pattern.sub(" ", text)
    names = set()
    for m in _WORD.finditer(text):
        word, is_call = m.group(1), m.group(2)
        if is_call or word.lower() in _KEYWORDS:
            continue
        names.add(re.sub(r"_(bucket|sum|count)$", "", word))
    return names


def dashboard() -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return parsed


def panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves are not panels."""
    out = []
    for panel in dashboard()["panels"]:
        out.extend(panel.get("panels", []))
        if panel["type"] != "row":
            out.append(panel)
    return out


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_the_metric_names_are_read_from_promql_correctly() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (stage, le) (rate(radixserve:first_token_stage_seconds"
        '_bucket{model_name=~"$model_name", code!~"2..|OK"}[$__rate_interval]))) / on (job) '
        "group_left(instance_id) max without (le) (process_open_fds offset 5m) > bool 1e3 "
        "and sglang:token_usage"
    )
    assert metric_names(expr) == {
        "radixserve:first_token_stage_seconds",
        "process_open_fds",
        "sglang:token_usage",
    }


def test_the_dashboard_is_current_and_asks_for_its_datasource() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36
    assert d["uid"] == "radixserve"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "instance_id"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", name
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*", name
        assert f", {name})" in v["query"] or v["query"] == f"label_values({name})", name


def test_every_panel_queries_the_chosen_prometheus() -> None:
    assert len(panels()) >= 30
    for panel in panels():
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], f"{title}: no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title


def test_every_metric_used_is_exported() -> None:
    used = set().union(*(metric_names(e) for e in exprs()))
    assert used <= KNOWN, f"not exported by any service: {sorted(used - KNOWN)}"


def test_every_exported_metric_has_a_panel() -> None:
    used = set().union(*(metric_names(e) for e in exprs()))
    assert used >= METRICS, f"exported but on no panel: {sorted(METRICS - used)}"
    assert used & PROCESS >= {"process_cpu_seconds_total", "process_resident_memory_bytes"}


def test_every_series_follows_the_model_and_instance_variables() -> None:
    for expr in exprs():
        for m in _SELECTOR.finditer(expr):
            matchers = m.group(2) or ""
            assert 'model_name=~"$model_name"' in matchers, (m.group(1), expr)
            assert 'instance_id=~"$instance_id"' in matchers, (m.group(1), expr)


def test_histograms_are_read_through_their_buckets() -> None:
    for expr in exprs():
        if "histogram_quantile" in expr:
            assert "_bucket{" in expr and "rate(" in expr, expr


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    everything = dashboard()["panels"]
    ids = [p["id"] for p in everything] + [c["id"] for p in everything for c in p.get("panels", [])]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in everything:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_provisioning_loads_the_dashboard_from_where_compose_mounts_it() -> None:
    grafana = compose({"REDIS_PASSWORD": "x"})["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    target = mounts["./deploy/grafana/radixserve-dashboard.json"]
    providers = GRAFANA / "provisioning" / "dashboards" / "radixserve.yml"
    (provider,) = yaml.safe_load(providers.read_text())["providers"]
    assert provider["type"] == "file"
    assert str(Path(target).parent) == provider["options"]["path"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == target
    for kind in ("datasources", "dashboards"):
        source = f"./deploy/grafana/provisioning/{kind}"
        assert mounts[source] == f"/etc/grafana/provisioning/{kind}"
    datasources = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
    (ds,) = yaml.safe_load(datasources.read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    assert ds["url"] == "http://prometheus:9090"  # the compose service, on its own port
