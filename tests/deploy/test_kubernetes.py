"""deploy/kubernetes: every manifest is valid against the Kubernetes API's own schemas (unknown
fields refused), kustomization.yaml applies exactly the files present, and the manifests agree
with one another and with the code: one workload per service running that service's command,
probes on declared ports, selectors that select, the autoscaler on the tokenizer, a GPU for the
executor, and the metrics port everywhere Prometheus and the probes expect it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from radixserve.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
NAMESPACE = "radixserve"
# The oldest Kubernetes the manifests are meant for (PodDisruptionBudget's
# unhealthyPodEvictionPolicy is GA in 1.31) and the newest kubernetes-validate 1.37 ships.
K8S_VERSIONS = ("1.31.0", "1.37.0")
SERVICES = ("gateway", "tokenizer", "grammar", "scheduler", "executor", "detokenizer")
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "StatefulSet"}
_VAR_REF = re.compile(r"\$\((\w+)\)")

Obj = dict[str, Any]


def manifest_files() -> list[Path]:
    return sorted(
        p for p in K8S.iterdir() if p.suffix in (".yaml", ".yml") and p.stem != "kustomization"
    )


def documents() -> Iterator[tuple[Path, Obj]]:
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path, doc


def objects(kind: str | None = None) -> list[Obj]:
    return [doc for _, doc in documents() if kind is None or doc["kind"] == kind]


def one(kind: str, name: str) -> Obj:
    found = [o for o in objects(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name}, found {len(found)}"
    return found[0]


def workloads() -> dict[str, Obj]:
    found: dict[str, Obj] = {}
    for o in objects():
        if o["kind"] in WORKLOADS:
            name = o["metadata"]["name"]
            assert name not in found, f"two workloads named {name}"
            found[name] = o
    return found


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Obj) -> list[Obj]:
    pod = pod_spec(workload)
    return list(pod.get("initContainers", [])) + list(pod["containers"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def shared_env() -> dict[str, str]:
    data: dict[str, str] = one("ConfigMap", "radixserve-env")["data"]
    return data


def image_uid() -> int:
    """The uid the Dockerfile creates its unprivileged user with."""
    m = re.search(r"useradd\b[^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert m, "the Dockerfile no longer creates its user with a fixed --uid"
    return int(m.group(1))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_api_schemas(version: str) -> None:
    problems = []
    count = 0
    for path, doc in documents():
        count += 1
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path)
            name = doc.get("metadata", {}).get("name")
            problems.append(f"{path.name}: {doc.get('kind')} {name}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{path.name}: no schema in Kubernetes {version}: {e}")
    assert count >= 10
    assert not problems, "\n".join(problems)


def test_kustomization_applies_exactly_the_manifests_present() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert k["namespace"] == NAMESPACE
    resources = k["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    assert sorted(resources) == [p.name for p in manifest_files()]


def test_every_object_is_in_the_namespace_with_our_labels() -> None:
    namespaces = objects("Namespace")
    assert [n["metadata"]["name"] for n in namespaces] == [NAMESPACE]
    for o in objects():
        meta = o["metadata"]
        if o["kind"] not in CLUSTER_SCOPED:
            assert meta.get("namespace") == NAMESPACE, (o["kind"], meta["name"])
        assert meta.get("labels", {}).get("app.kubernetes.io/name") == "radixserve", meta["name"]


def test_each_service_has_a_workload_running_its_command() -> None:
    # A service added to the CLI needs a workload here (and a scrape job, and panels).
    assert set(SERVICES) == set(COMMANDS) - {"serve"}
    assert '["radixserve"]' in (ROOT / "Dockerfile").read_text()  # ENTRYPOINT: args follow it
    found = workloads()
    for service in SERVICES:
        w = found.get(service)
        assert w is not None, f"no workload for {service}"
        assert w["kind"] == "Deployment", service
        (c,) = pod_spec(w)["containers"]
        assert c["image"].split(":")[0] == "radixserve", service
        assert "command" not in c, f"{service}: keep the image's ENTRYPOINT (radixserve)"
        assert c["args"][0] == service, service
        assert c.get("imagePullPolicy") == "IfNotPresent", service
    assert found["redis"]["kind"] == "StatefulSet"  # never two Redis pods at once


def test_the_flags_and_shared_env_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each pod would run, through its service's own argument parser."""
    import importlib

    for var, value in shared_env().items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("REDIS_URL", "redis://:secret@redis:6379/0")
    for service in SERVICES:
        (c,) = pod_spec(workloads()[service])["containers"]
        module = importlib.import_module(f"services.{service}.main")
        parse = getattr(module, "parse_args", None)
        argv = [str(a) for a in c["args"][1:]]
        a = parse(argv) if parse is not None else module.build_parser().parse_args(argv)
        assert a.redis_url == "redis://:secret@redis:6379/0", service
        assert a.metrics_port == int(shared_env()["RADIXSERVE_METRICS_PORT"]), service
        # Empty variables leave the flags at their defaults: tracing off.
        assert (a.otlp_traces_endpoint, a.otlp_traces_protocol) == ("", "http/protobuf"), service


def test_selectors_select_what_they_mean() -> None:
    found = workloads()
    for name, w in found.items():
        template_labels = w["spec"]["template"]["metadata"]["labels"]
        assert selects(w["spec"]["selector"]["matchLabels"], template_labels), name
        assert template_labels["app.kubernetes.io/component"] == name
    pods = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in found.items()}

    def selected(selector: dict[str, str]) -> set[str]:
        return {name for name, labels in pods.items() if selects(selector, labels)}

    assert selected(one("Service", "gateway")["spec"]["selector"]) == {"gateway"}
    assert selected(one("Service", "redis")["spec"]["selector"]) == {"redis"}
    assert one("StatefulSet", "redis")["spec"]["serviceName"] == "redis"
    pdb = one("PodDisruptionBudget", "gateway")
    assert selected(pdb["spec"]["selector"]["matchLabels"]) == {"gateway"}
    assert found["gateway"]["spec"]["replicas"] > pdb["spec"]["minAvailable"]
    policy = one("NetworkPolicy", "redis")
    assert selected(policy["spec"]["podSelector"]["matchLabels"]) == {"redis"}
    (rule,) = policy["spec"]["ingress"]
    allowed = set().union(*(selected(f["podSelector"]["matchLabels"]) for f in rule["from"]))
    assert allowed >= set(SERVICES)


def test_services_target_declared_ports() -> None:
    found = workloads()
    for svc in objects("Service"):
        (target,) = (
            w
            for w in found.values()
            if selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        )
        declared = {p["name"] for c in containers(target) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in declared, (svc["metadata"]["name"], port)
    gateway = {p["name"]: p["port"] for p in one("Service", "gateway")["spec"]["ports"]}
    assert gateway == {"http": 8000, "grpc": 50051}


def test_every_probe_points_at_a_declared_port() -> None:
    metrics_port = int(shared_env()["RADIXSERVE_METRICS_PORT"])
    for name, w in workloads().items():
        for c in containers(w):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if name in SERVICES:
                    assert probe is not None, f"{name}: no {kind}"
                if probe is None:
                    continue
                for action in ("httpGet", "tcpSocket", "grpc"):
                    if action in probe:
                        port = probe[action]["port"]
                        assert port in ports or port in ports.values(), (name, kind, port)
            if name in SERVICES:
                assert ports.get("metrics") == metrics_port, name
                assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}


def test_gateway_readiness_is_end_to_end_and_liveness_is_the_process() -> None:
    (c,) = pod_spec(one("Deployment", "gateway"))["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 8000 and ports["grpc"] == 50051
    args = c["args"]
    assert args[args.index("--port") + 1] == str(ports["http"])
    assert args[args.index("--grpc-port") + 1] == str(ports["grpc"])
    assert args[args.index("--host") + 1] == "0.0.0.0"


def test_prometheus_annotations_match_the_metrics_port() -> None:
    metrics_port = shared_env()["RADIXSERVE_METRICS_PORT"]
    for service in SERVICES:
        annotations = workloads()[service]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", service
        assert annotations["prometheus.io/port"] == metrics_port, service
        assert annotations["prometheus.io/path"] == "/metrics", service


def test_the_autoscaler_drives_the_tokenizer_on_cpu() -> None:
    (hpa,) = objects("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "tokenizer")
    tokenizer = one("Deployment", "tokenizer")
    assert "replicas" not in tokenizer["spec"], "an apply would reset what the autoscaler set"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    (c,) = pod_spec(tokenizer)["containers"]
    assert "cpu" in c["resources"]["requests"]  # utilization is a share of the request
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_the_executor_gets_a_gpu_and_time_to_load() -> None:
    executor = one("Deployment", "executor")
    (c,) = pod_spec(executor)["containers"]
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert executor["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"]["mountPath"] == "/models" and mounts["models"]["readOnly"]
    # a restarted container keeps what its start saved: the pod's volume holds the caches
    cache = Path(mounts["cache"]["mountPath"])
    volumes = {v["name"]: v for v in pod_spec(executor)["volumes"]}
    assert "emptyDir" in volumes["cache"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert Path(env["TRITON_CACHE_DIR"]).is_relative_to(cache)


def test_every_container_has_requests_and_limits() -> None:
    for name, w in workloads().items():
        for c in containers(w):
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"].get(part, {})), (name, part)


def test_env_references_resolve() -> None:
    """`$(VAR)` expands only from variables defined before it in the container (envFrom
    first); an unknown one stays in the value as literal text."""
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objects("ConfigMap")}
    secrets = {o["metadata"]["name"]: o.get("stringData", {}) for o in objects("Secret")}
    claims = {o["metadata"]["name"] for o in objects("PersistentVolumeClaim")}
    for name, w in workloads().items():
        for c in containers(w):
            defined: set[str] = set()
            for source in c.get("envFrom", []):
                ref = source["configMapRef"]["name"]
                assert ref in configmaps, (name, ref)
                defined |= set(configmaps[ref])
            for var in c.get("env", []):
                for used in _VAR_REF.findall(var.get("value", "")):
                    assert used in defined, f"{name}: {var['name']} uses $({used}) before it"
                key_ref = var.get("valueFrom", {}).get("secretKeyRef")
                if key_ref and not key_ref.get("optional"):
                    assert key_ref["key"] in secrets.get(key_ref["name"], {}), (name, key_ref)
                defined.add(var["name"])
            for arg in c.get("args", []):
                for used in _VAR_REF.findall(str(arg)):
                    assert used in defined, f"{name}: args use $({used})"
            if name in SERVICES:
                url = next(v["value"] for v in c["env"] if v["name"] == "REDIS_URL")
                assert url == "redis://:$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0", name
        for volume in pod_spec(w).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name
    redis_service = one("Service", "redis")["spec"]["ports"][0]["port"]
    assert shared_env()["REDIS_ADDRESS"] == f"redis:{redis_service}"


def test_redis_requires_the_secret_password() -> None:
    (c,) = pod_spec(one("StatefulSet", "redis"))["containers"]
    args = c["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {v["name"]: v for v in c["env"]}
    secret = {"name": "radixserve-redis", "key": "password"}
    for var in ("REDIS_PASSWORD", "REDISCLI_AUTH"):
        assert env[var]["valueFrom"]["secretKeyRef"] == secret, var


def test_detokenizers_cover_every_partition_with_a_standby() -> None:
    detok = one("Deployment", "detokenizer")
    (c,) = pod_spec(detok)["containers"]
    # Unpinned: each takes a free partition, and the spare takes over a dead owner's.
    assert "--partition" not in c["args"]
    assert detok["spec"]["replicas"] > int(shared_env()["RADIXSERVE_DETOKENIZER_PARTITIONS"])


def test_pods_meet_the_restricted_pod_security_standard() -> None:
    namespace = one("Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    uid = image_uid()
    for name, w in workloads().items():
        pod = pod_spec(w)
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True, name
        assert security["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name
        assert pod.get("enableServiceLinks") is False, name
        if name in SERVICES:
            # The image's USER is a name, which the kubelet cannot check is not root.
            assert security["runAsUser"] == uid, name
        for c in containers(w):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        for volume in pod.get("volumes", []):
            assert "hostPath" not in volume, name
