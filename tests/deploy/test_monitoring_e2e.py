"""End to end: the real service (`python -m wcodec serve`, CPU, the demo model built into an empty
store) and a real Prometheus on loopback scraping it every second with deploy/prometheus's config
(the target rewritten) and alert rules. After some traffic (generates in two waves so that the
queue overflows, a stream read to the end and one dropped, a 404 and a 422, an unload and a
reload), every dashboard panel's query and every alert rule is evaluated through Prometheus's
HTTP API with the dashboard's variables substituted: each must be valid, and each panel's must
return series. The table of what came back is printed and written to e2e_panels.txt."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from deploy_helpers import (LABEL_VALUES, PROMETHEUS, ROOT, alert_rules, dashboard, dashboard_and_alert_metrics,
                            grafana_regex, k8s_kind, panel_queries, substitute, variables)

from service.load.demo import DEMO_NAME

pytestmark = [
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="the prometheus server is not installed (Debian's prometheus package; make test "
                              "installs it)"),
    pytest.mark.timeout(300),
]
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
SCRAPE = "1s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A child process whose output goes to `log`; stopped (SIGTERM, then SIGKILL) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def wait_for(what: str, check: Callable[[], bool], timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what}: the process exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{what}: not within {timeout} s:\n{log.read_text()[-3000:]}")


@dataclass
class Stack:
    service: httpx.Client
    prometheus: httpx.Client
    instance: str
    tmp: Path

    def query(self, expr: str) -> dict:
        """Prometheus's answer to an instant query, success or error."""
        return self.prometheus.get("/api/v1/query", params={"query": expr}).json()

    def vector(self, expr: str) -> list[dict]:
        answer = self.query(expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def label_values(self, query: str, values: dict[str, str]) -> list[str]:
        """A `label_values(selector, label)` variable, evaluated as Grafana does: a series query."""
        m = LABEL_VALUES.match(substitute(query, values))
        answer = self.prometheus.get("/api/v1/series", params={"match[]": m["selector"]}).json()
        assert answer["status"] == "success", (query, answer)
        return sorted({s[m["label"]] for s in answer["data"] if m["label"] in s})

    def scalar(self, expr: str) -> float:
        result = self.vector(expr)
        return float(result[0]["value"][1]) if result else 0.0


def prometheus_config(tmp: Path, target: str) -> Path:
    """deploy/prometheus/prometheus.yml with the wcodec job aimed at `target`, scraping every second."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    config["global"].update(scrape_interval=SCRAPE, evaluation_interval=SCRAPE)
    config["rule_files"] = [str(PROMETHEUS.parent / f) for f in config["rule_files"]]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "wcodec"]
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def service_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WCODEC_")}
    return env | {"WCODEC_DEVICE": "cpu", "WCODEC_DEMO_WORKERS": "2", "WCODEC_LOG_LEVEL": "warning",
                  # a short queue and a batch window: the second wave of requests overflows (429s)
                  "WCODEC_MAX_QUEUE": "3", "WCODEC_BATCH_WAIT_MS": "20",
                  "WCODEC_NO_JIT": "1"}                           # as in the image: never compile


def drive(client: httpx.Client) -> dict[str, int]:
    """Traffic that gives every panel data; returns how many answers had each status code."""
    def generate(tokens: int, **extra) -> int:
        return client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": tokens},
                                              **extra}).status_code
    with ThreadPoolExecutor(9) as pool:
        first = [pool.submit(generate, 24) for _ in range(3)]
        time.sleep(0.2)                                    # the first batch is generating
        second = [pool.submit(generate, 8) for _ in range(6)]
        codes = [f.result() for f in first + second]
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
    with client.stream("POST", "/generate_stream", json=body) as r:
        codes.append(r.status_code)
        assert sum(line.startswith("data:") for line in r.iter_lines()) >= 1
    with client.stream("POST", "/generate_stream", json=body | {"parameters": {"max_new_tokens": 200}}) as r:
        codes.append(r.status_code)
        next(r.iter_lines())                               # then hang up: the request is cancelled
    codes.append(generate(4, model="no-such-model"))
    codes.append(client.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 2}}).status_code)
    codes.append(client.post(f"/models/{DEMO_NAME}/unload").status_code)
    codes.append(client.post(f"/models/{DEMO_NAME}/load").status_code)
    codes.append(generate(8))
    return {str(c): codes.count(c) for c in sorted(set(codes))}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e")
    svc_port, prom_port = free_port(), free_port()
    instance = f"127.0.0.1:{svc_port}"
    prom_cmd = ["prometheus", f"--config.file={prometheus_config(tmp, instance)}",
                f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn"]
    svc_cmd = [sys.executable, "-m", "wcodec", "serve", "--host", "127.0.0.1", "--port", str(svc_port),
               "--store", str(tmp / "models")]
    with ExitStack() as stop:
        prom = stop.enter_context(process(prom_cmd, tmp / "prometheus.log"))
        svc = stop.enter_context(process(svc_cmd, tmp / "service.log", service_env()))
        # trust_env=False: straight to loopback, whatever proxy the environment names
        service = stop.enter_context(httpx.Client(base_url=f"http://{instance}", timeout=120, trust_env=False))
        prometheus = stop.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=30,
                                                     trust_env=False))
        s = Stack(service, prometheus, instance, tmp)
        wait_for("prometheus ready", lambda: prometheus.get("/-/ready").status_code == 200, 30, prom,
                 tmp / "prometheus.log")
        wait_for("the demo model ready", lambda: service.get("/health/ready").status_code == 200, 240, svc,
                 tmp / "service.log")
        wait_for("a scrape", lambda: s.scalar('up{job="wcodec"}') == 1, 30, prom, tmp / "prometheus.log")
        started = time.monotonic()
        codes = drive(service)
        print(f"\ntraffic: answers by status {codes} in {time.monotonic() - started:.1f} s")
        assert codes.get("200", 0) >= 6 and codes.get("404") == 1 and codes.get("422") == 1
        wait_for("prometheus has the reload", lambda: s.scalar('sum(wcodec_model_loads_total{result="ok"})') >= 2,
                 30, prom, tmp / "prometheus.log")
        time.sleep(3)                                          # a few more scrapes and rule evaluations
        yield s


def variable_values(stack: Stack) -> dict[str, str]:
    """Each dashboard variable's values, in Grafana's regex form, resolved in order."""
    values: dict[str, str] = {}
    for name, query in variables(dashboard()).items():
        found = stack.label_values(query, values)
        assert found, f"${name}: {query} found nothing"
        values[name] = grafana_regex(found)
    return values


def sample(result: list[dict]) -> str:
    if not result:
        return "-"
    labels = {k: v for k, v in result[0]["metric"].items() if k != "__name__"}
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} " + result[0]["value"][1]


def report(stack: Stack, title: str, rows: list[tuple[str, str, list[dict]]]) -> None:
    lines = [f"{title}", f"{'':4}{'series':>6}  sample (first series, value)"]
    for name, expr, result in rows:
        lines += [f"{name}", f"{'':4}{len(result):>6}  {sample(result)}", f"{'':12}{' '.join(expr.split())}"]
    text = "\n".join(lines) + "\n"
    with (stack.tmp / "e2e_panels.txt").open("a") as f:
        f.write(text + "\n")
    print("\n" + text)


def test_dashboard_variables_resolve_to_the_service(stack: Stack) -> None:
    values = variable_values(stack)
    assert values["instance"] == grafana_regex([stack.instance])
    assert values["model"] == grafana_regex([DEMO_NAME])


def test_every_panel_query_is_valid_and_returns_series(stack: Stack) -> None:
    values = variable_values(stack)
    rows, empty = [], []
    for q in panel_queries(dashboard()):
        expr = substitute(q.expr, values)
        result = stack.vector(expr)
        rows.append((f"{q.panel} [{q.ref}]", expr, result))
        if not result:
            empty.append(f"{q.panel} [{q.ref}]")
        everything = stack.vector(substitute(q.expr, {name: ".*" for name in values}))    # "All" selected
        assert len(everything) == len(result), q
    report(stack, f"dashboard panels (instance {stack.instance}, model {DEMO_NAME})", rows)
    assert not empty, f"panels without data: {empty}"


def test_every_alert_rule_is_valid_and_healthy(stack: Stack) -> None:
    rows = []
    for rule in alert_rules():
        answer = stack.query(rule["expr"])
        assert answer["status"] == "success", (rule["alert"], answer)
        rows.append((f"alert {rule['alert']}", rule["expr"], answer["data"]["result"]))
    report(stack, "alert rules (series = the alert's expression firing now)", rows)
    groups = stack.prometheus.get("/api/v1/rules").json()["data"]["groups"]
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]}
    assert health == {r["alert"]: ("ok", "") for r in alert_rules()}


def test_names_and_paths_in_the_manifests_are_live(stack: Stack) -> None:
    """Every metric the dashboard and the alerts name is on the live /metrics, and every probe
    path of the Deployment answers 200 once the model is ready."""
    text = stack.service.get("/metrics").text
    live = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    missing = {name: sorted(where) for name, where in dashboard_and_alert_metrics().items()
               if name not in live | {"up"}}
    assert not missing, f"not on the live /metrics: {missing}"
    (container,) = k8s_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert stack.service.get(container[probe]["httpGet"]["path"]).status_code == 200, probe
