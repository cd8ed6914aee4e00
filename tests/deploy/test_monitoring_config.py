"""Prometheus and Grafana configuration, without running them: promtool checks the config and the
rules and runs the alerts' unit tests; the dashboard is checked the way Grafana would load it (the
provisioned datasource, the variables, a query on every panel) and every metric it or an alert
names is one the service's registry exposes, with every label the query uses (promql_labels.py). tests/deploy/test_monitoring_e2e.py runs them live."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from deploy_helpers import (ALERT_TESTS, ALERTS, DASHBOARD, DATASOURCES, LABEL_VALUES, PROMETHEUS, PROVIDERS,
                            alert_rules, dashboard, dashboard_and_alert_metrics, exposed_metric_names,
                            load_yaml, panel_queries, panels, variables)
from promql_labels import exposed_labels, label_problems, output_labels

SELECTOR = re.compile(r"\b(wcodec_[a-z0-9_]+)(\{[^}]*\})?")
# what the issue asks the dashboard to show, as metrics its panels must read
REQUIRED_METRICS = {
    "decode throughput": "wcodec_decode_decoded_bytes_total",
    "decode latency": "wcodec_decode_batch_duration_seconds_bucket",
    "load time by phase": "wcodec_model_load_duration_seconds_sum",
    "models resident": "wcodec_model_state",
    "GPU memory": "wcodec_gpu_memory_allocated_bytes",
    "request rate and errors": "wcodec_generate_requests_total",
    "request latency": "wcodec_generate_request_duration_seconds_bucket",
    "time to first token": "wcodec_generate_time_to_first_token_seconds_bucket",
    "its queue": "wcodec_generate_queue_duration_seconds_bucket",
    "its prefill": "wcodec_generate_prefill_duration_seconds_bucket",
    "tokens/s": "wcodec_generate_generated_tokens_total",
    "queue depth": "wcodec_generate_queue_depth",
    "running requests": "wcodec_generate_running_requests",
    "batch size": "wcodec_generate_batch_size_bucket",
    "process start to ready": "wcodec_process_start_to_ready_seconds",
    "batch size in tokens": "wcodec_generate_batch_tokens_bucket",
    "inter-token latency": "wcodec_generate_inter_token_latency_seconds_bucket",
    "weight bytes, decoded or compressed": "wcodec_model_weight_bytes",
    "forward decode time": "wcodec_forward_decode_duration_seconds_bucket",
    "KV cache usage": "wcodec_kv_cache_usage",
    "blocks in use": "wcodec_kv_cache_blocks_used",
    "CUDA graphs": "wcodec_engine_cuda_graphs",
}


def promtool(*args: str) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; make test installs it)")
    run = subprocess.run(["promtool", *args], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_promtool_check_config() -> None:
    promtool("check", "config", str(PROMETHEUS))


def test_promtool_check_rules() -> None:
    promtool("check", "rules", str(ALERTS))


def test_promtool_alert_unit_tests() -> None:
    """Each alert fires on the series it is meant for (and not before its `for`)."""
    promtool("test", "rules", str(ALERT_TESTS))
    tested = {t["alertname"] for case in load_yaml(ALERT_TESTS)["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]}


def test_alerts_cover_failed_loads_throughput_latency_and_the_queue() -> None:
    exprs = {r["alert"]: r["expr"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]}
    assert "failed" in exprs["WcodecModelLoadFailed"]
    assert "wcodec_model_load_throughput_bytes_per_second" in exprs["WcodecDecodeThroughputDrop"]
    assert "wcodec_generate_request_duration_seconds_bucket" in exprs["WcodecHighRequestLatency"]
    assert "wcodec_generate_queue_depth" in exprs["WcodecQueueSaturated"]


def test_grafana_provisioning_points_at_the_dashboard_and_the_datasource() -> None:
    (source,) = load_yaml(DATASOURCES)["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dash = dashboard()
    datasources = [p["datasource"] for p in panels(dash)] + [v["datasource"] for v in dash["templating"]["list"]]
    datasources += [t["datasource"] for p in panels(dash) for t in p["targets"]]
    assert {(d["type"], d["uid"]) for d in datasources} == {("prometheus", source["uid"])}


def test_dashboard_has_model_and_instance_variables() -> None:
    found = variables(dashboard())
    assert list(found) == ["instance", "model"]            # model's query narrows by $instance
    assert all(q.startswith("label_values(") for q in found.values())
    assert "$instance" in found["model"]


def test_every_panel_queries_prometheus_filtered_by_the_variables() -> None:
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and DASHBOARD.name == f"{dash['uid']}.json"
    for p in panels(dash):
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    exposed = exposed_metric_names()
    for q in panel_queries(dash):
        for name, matchers in SELECTOR.findall(q.expr):
            assert 'instance=~"$instance"' in matchers, (q.panel, name)
            if not name.startswith(("wcodec_gpu_", "wcodec_http_", "wcodec_process_",   # families without `model`
                                    "wcodec_host_cache_bytes", "wcodec_host_cache_pinned", "wcodec_host_cache_entries")):
                assert 'model=~"$model"' in matchers, (q.panel, name)
            assert name in exposed, (q.panel, name)


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    used = dashboard_and_alert_metrics()
    for what, metric in REQUIRED_METRICS.items():
        assert any(not u.startswith(("$", "Wcodec")) for u in used.get(metric, ())), what


def test_every_metric_named_is_one_the_service_exposes() -> None:
    missing = {name: sorted(where) for name, where in dashboard_and_alert_metrics().items()
               if name not in exposed_metric_names() | {"up"}}
    assert not missing, f"not in service/metrics.py: {missing}"


def test_every_label_a_panel_or_an_alert_uses_is_one_its_metrics_carry() -> None:
    """A matcher, a `by (...)`, a legend's or an annotation's label the metric lacks selects
    nothing, merges series or prints an empty name, and the metric-name checks above pass."""
    known = exposed_labels()
    dash = dashboard()
    for p in panels(dash):
        for t in p["targets"]:
            assert not label_problems(t["expr"], known, t.get("legendFormat", "")), (p["title"], t["refId"])
    for v, query in variables(dash).items():
        selector, label = LABEL_VALUES.match(query).group("selector", "label")
        assert not label_problems(selector, known) and label in output_labels(selector, known), v
    for rule in alert_rules():
        printed = " ".join(rule.get("annotations", {}).values())
        assert not label_problems(rule["expr"], known, printed, frozenset(rule["labels"])), rule["alert"]


@pytest.mark.parametrize(("expr", "printed", "problem"), [
    ('sum by (model) (rate(wcodec_http_requests_total{instance=~"a"}[1m]))', "", "by (model)"),
    ('wcodec_generate_requests_total{state="ok"}', "", "no label 'state'"),
    ('histogram_quantile(0.9, sum by (model) (rate(wcodec_generate_request_duration_seconds_bucket[1m])))', "",
     "buckets merged"),
    ('sum by (model) (wcodec_model_state)', "{{state}}", "prints 'state'"),
    ('wcodec_kv_cache_usage / on (phase) wcodec_kv_cache_blocks', "", "on (phase)"),
])
def test_the_label_check_finds_a_wrong_label(expr, printed, problem) -> None:
    found = label_problems(expr, exposed_labels(), printed)
    assert any(problem in p for p in found), found
