"""The compose file and the Kubernetes manifests: valid against their schemas (compose-spec, the
Kubernetes API), and naming the port, the health paths, the model store and the metrics path that
the service really has."""
from __future__ import annotations

import subprocess
import sys

import pytest
from deploy_helpers import (COMPOSE, DATASOURCES, DEPLOY, PROMETHEUS, PROVIDERS, k8s_documents, k8s_kind,
                            load_yaml, served_paths)

from service.settings import Settings

PORT = Settings().port
STORE = "/models"                                        # the image's WCODEC_MODEL_STORE and VOLUME
CACHE = "/cache"                                         # the image's XDG_CACHE_HOME and VOLUME


def test_compose_file_is_valid_compose_spec() -> None:
    pytest.importorskip("check_jsonschema", reason="check-jsonschema is not installed (pip install -e .[test])")
    run = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE)], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_compose_runs_wcodec_on_a_gpu_with_the_store_and_the_port() -> None:
    compose = load_yaml(COMPOSE)
    wcodec = compose["services"]["wcodec"]
    assert wcodec["build"] == {"context": "..", "dockerfile": "Dockerfile", "args": {"TORCH_VARIANT": "cuda"}}
    (gpu,) = wcodec["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    env = wcodec["environment"]
    assert env["WCODEC_PORT"] == str(PORT) and env["WCODEC_MODEL_STORE"] == STORE
    assert [p.rsplit(":", 1)[1] for p in wcodec["ports"]] == [str(PORT)]
    assert [v.split(":")[1] for v in wcodec["volumes"]] == [STORE, CACHE]
    assert wcodec["read_only"] is True and wcodec["tmpfs"] == ["/tmp"]
    assert set(compose["volumes"]) >= {v.split(":")[0] for s in compose["services"].values()
                                       for v in s.get("volumes", []) if not v.startswith(".")}


def test_compose_prometheus_scrapes_wcodec_and_grafana_reads_prometheus() -> None:
    compose = load_yaml(COMPOSE)
    prometheus, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert "./prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    (job,) = [j for j in load_yaml(PROMETHEUS)["scrape_configs"] if j["job_name"] == "wcodec"]
    assert job["static_configs"] == [{"targets": [f"wcodec:{PORT}"]}]
    assert job["metrics_path"] in served_paths()
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./grafana/dashboards"] == load_yaml(PROVIDERS)["providers"][0]["options"]["path"]
    assert load_yaml(DATASOURCES)["datasources"][0]["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090") for p in prometheus["ports"]) and any(p.endswith(":3000") for p in grafana["ports"])
    for src in [m for m in mounts if m.startswith(".")] + ["./prometheus"]:
        assert (DEPLOY / src).is_dir(), src


def test_k8s_manifests_are_valid_kubernetes_objects() -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed (pip install -e .[test])")
    kinds = []
    for path, doc in k8s_documents():
        kinds.append(doc["kind"])
        if doc["apiVersion"].startswith(("kustomize.", "monitoring.coreos.com")):
            continue                                      # CRDs: no schema in the Kubernetes API
        kv.validate(doc, kv.latest_version(), strict=True)
    assert sorted(kinds) == ["Deployment", "Kustomization", "PersistentVolumeClaim", "Service", "ServiceMonitor"]
    listed = set(k8s_kind("Kustomization")["resources"])
    assert listed == {p.name for p, d in k8s_documents() if d["kind"] not in ("Kustomization", "ServiceMonitor")}


def test_k8s_deployment_probes_port_gpu_and_store() -> None:
    deployment = k8s_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (port,) = c["ports"]
    assert port == {"name": "http", "containerPort": PORT}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["WCODEC_PORT"] == str(PORT) and env["WCODEC_MODEL_STORE"] == STORE
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: p["path"] for k, p in probes.items()} == {
        "startupProbe": "/health/ready", "readinessProbe": "/health/ready", "livenessProbe": "/health"}
    assert {p["port"] for p in probes.values()} == {"http"}
    assert {p["path"] for p in probes.values()} <= served_paths()
    # a read-only root: the store, the caches and /tmp are volumes
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == {STORE, CACHE, "/tmp"} and set(mounts.values()) == set(volumes)
    claim = volumes[mounts[STORE]]["persistentVolumeClaim"]["claimName"]
    assert claim == k8s_kind("PersistentVolumeClaim")["metadata"]["name"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001


def test_k8s_service_and_scraping_name_the_service_port_and_metrics_path() -> None:
    deployment, service, monitor = k8s_kind("Deployment"), k8s_kind("Service"), k8s_kind("ServiceMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port == {"name": "http", "port": PORT, "targetPort": "http"}
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT), "prometheus.io/path": "/metrics"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] in served_paths()
