"""deploy/prometheus/prometheus.yml: one job per service, each finding every replica through
compose's DNS on the port compose.yaml gives RADIXSERVE_METRICS_PORT, and the file mounted
where the pinned Prometheus image reads its configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from radixserve.cli import COMMANDS
from tests.test_compose import compose

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def jobs() -> dict[str, dict[str, Any]]:
    parsed = yaml.safe_load(CONFIG.read_text())
    names = [job["job_name"] for job in parsed["scrape_configs"]]
    assert len(names) == len(set(names)), "a job is defined twice"
    return {job["job_name"]: job for job in parsed["scrape_configs"]}


def radixserve_services() -> dict[str, dict[str, Any]]:
    services = compose({"REDIS_PASSWORD": "x"})
    return {n: s for n, s in services.items() if s.get("image") == "radixserve:latest"}


def test_every_service_has_a_job_of_its_name() -> None:
    services = radixserve_services()
    assert set(services) == set(COMMANDS) - {"serve"}  # all six, and nothing unscraped
    assert set(jobs()) == set(services)


def test_each_job_finds_every_replica_on_the_metrics_port() -> None:
    services = radixserve_services()
    for name, job in jobs().items():
        port = int(services[name]["environment"]["RADIXSERVE_METRICS_PORT"])
        (sd,) = job["dns_sd_configs"]
        assert sd["names"] == [name] and sd["type"] == "A" and sd["port"] == port, name
        assert job.get("metrics_path", "/metrics") == "/metrics", name
        assert "static_configs" not in job, f"{name}: a static target misses --scale replicas"


def test_intervals_parse_and_the_file_is_mounted_where_prometheus_reads_it() -> None:
    parsed = yaml.safe_load(CONFIG.read_text())
    interval = parsed["global"]["scrape_interval"]
    timeout = parsed["global"]["scrape_timeout"]
    assert interval.endswith("s") and timeout.endswith("s")
    assert float(timeout[:-1]) < float(interval[:-1])
    prometheus = compose({"REDIS_PASSWORD": "x"})["prometheus"]
    mount = "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in prometheus["volumes"]
    # Grafana's rate windows assume this interval (deploy/grafana/provisioning).
    datasources = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    (ds,) = yaml.safe_load(datasources.read_text())["datasources"]
    assert ds["jsonData"]["timeInterval"] == interval
