"""What the deploy tests share: the files under deploy/, the dashboard's queries and variables,
Grafana's variable substitution, and the metric names the service exposes."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "wcodec.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "wcodec.yml"

# what Grafana puts for its built-in interval variables when the tests evaluate a panel
BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def k8s_documents() -> Iterator[tuple[Path, dict]]:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def k8s_kind(kind: str) -> dict:
    (doc,) = [d for _, d in k8s_documents() if d["kind"] == kind]
    return doc


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    """Every panel that draws something (rows and the panels collapsed inside them, flattened)."""
    out = []
    for p in dash["panels"]:
        out.extend(panels(p) if p["type"] == "row" else [p])
    return out


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str


def panel_queries(dash: dict) -> list[Query]:
    return [Query(p["title"], t["refId"], t["expr"]) for p in panels(dash) for t in p["targets"]]


def variables(dash: dict) -> dict[str, str]:
    """name -> the variable's query, in the dashboard's order (a later one may use an earlier one)."""
    out = {}
    for v in dash["templating"]["list"]:
        query = v["query"]
        out[v["name"]] = query["query"] if isinstance(query, dict) else query
    return out


def alert_rules() -> list[dict]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable as Grafana writes it into `=~"..."`: each value regex-escaped (and the
    escape doubled, for the PromQL string), several as (a|b)."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's interpolation: the built-in intervals, then $name and ${name} of each variable."""
    for name, value in BUILTINS.items():
        expr = expr.replace(name, value)
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def metric_names(expr: str) -> set[str]:
    stripped = re.sub(r'"[^"]*"', '""', expr)                 # not inside label matchers
    stripped = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", stripped)
    return {m for m in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", stripped) if m.startswith("wcodec_") or m == "up"}


def exposed_metric_names() -> set[str]:
    """Every sample name the service's registry can expose, by metric type, labelled or not."""
    from promql_labels import exposed_labels

    return set(exposed_labels()) - {"up"}


def dashboard_and_alert_metrics() -> dict[str, set[str]]:
    """metric name -> where it is used (panel titles and alert names)."""
    used: dict[str, set[str]] = {}
    for q in panel_queries(dashboard()):
        for name in metric_names(q.expr):
            used.setdefault(name, set()).add(q.panel)
    for v, query in variables(dashboard()).items():
        for name in metric_names(query):
            used.setdefault(name, set()).add(f"${v}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(rule["alert"])
    return used


def served_paths() -> set[str]:
    """The HTTP paths the app serves (its OpenAPI schema: every route, included routers too)."""
    from service.app import create_app
    from service.settings import Settings

    return set(create_app(Settings()).openapi()["paths"])
