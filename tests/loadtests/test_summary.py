"""The load run's server view covers its own window: the server's counters and histograms are read
before and after a run and subtracted, so a server that served earlier runs (the generation bench's
one user, then 32) reports each run alone. The pages are the service's own /metrics (metrics.py)."""
from __future__ import annotations

from loadtests.summary import parse_metrics, summarize, window
from service.metrics import Metrics


def _steps(m: Metrics, rows: int, n: int) -> None:
    for _ in range(n):
        m.batch_size.labels("demo").observe(rows)
        m.batch_tokens.labels("demo").observe(rows + 2)
        m.itl.labels("demo").observe(0.005)


def test_a_run_against_a_used_server_reports_its_own_steps() -> None:
    m = Metrics()
    _steps(m, 1, 300)                                   # an earlier run: one user
    m.requests.labels("demo", "ok").inc(10)
    m.queue_depth.labels("demo").set(5)
    before = parse_metrics(m.render().decode())
    _steps(m, 28, 100)                                  # this run: 28 rows a step
    m.requests.labels("demo", "ok").inc(7)
    m.requests.labels("demo", "cancelled").inc(2)       # a series this run starts
    m.queue_depth.labels("demo").set(0)
    after = parse_metrics(m.render().decode())

    server = summarize([], 0.0, 1.0, window(before, after))["server"]
    assert server["requests"] == {"ok": 7.0, "cancelled": 2.0}
    assert server["mean_rows_per_step"] == 28.0 and server["mean_tokens_per_step"] == 30.0
    assert abs(server["mean_inter_token_latency_s"] - 0.005) < 1e-12
    whole = summarize([], 0.0, 1.0, after)["server"]    # what one reading after the run gave
    assert whole["mean_rows_per_step"] == (300 + 28 * 100) / 400


def test_parse_keeps_only_what_grows() -> None:
    m = Metrics()
    _steps(m, 4, 3)
    m.queue_depth.labels("demo").set(3)
    series = parse_metrics(m.render().decode())
    assert series['wcodec_generate_batch_size_count{model="demo"}'] == 3.0
    assert series['wcodec_generate_batch_size_sum{model="demo"}'] == 12.0
    assert not [k for k in series if "_bucket" in k or "_created" in k or "queue_depth" in k]


def test_a_restarted_server_counts_from_zero() -> None:
    assert window({"a_total": 50.0, "b_count": 4.0}, {"a_total": 3.0, "b_count": 6.0, "c_sum": 1.0}) == \
        {"a_total": 3.0, "b_count": 2.0, "c_sum": 1.0}


def test_the_server_view_splits_its_time_to_first_token() -> None:
    m = Metrics()
    for queue, prefill in ((0.010, 0.030), (0.050, 0.030)):           # two requests' first tokens
        m.ttft.labels("demo").observe(queue + prefill)
        m.queue_seconds.labels("demo").observe(queue)
        m.prefill_seconds.labels("demo").observe(prefill)
    server = summarize([], 0.0, 1.0, parse_metrics(m.render().decode()))["server"]
    assert abs(server["mean_queue_s"] - 0.030) < 1e-12 and abs(server["mean_prefill_s"] - 0.030) < 1e-12
    assert abs(server["mean_queue_s"] + server["mean_prefill_s"] - server["mean_ttft_s"]) < 1e-12
