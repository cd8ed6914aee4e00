"""The numbers of a load run, from its records (loadtests/locustfile.py) and the server's /metrics."""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    s, k = sorted(values), (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records: list, t0: float, duration: float, server: dict[str, float]) -> dict:
    end = t0 + duration
    started = [r for r in records if r.start < end and r.end]
    done = [r for r in started if r.error is None and not r.disconnected]
    rejected = [r for r in started if r.status == 429]
    errors = [r for r in started if r.error is not None and r.status != 429]
    tokens = sum(1 for r in records for t in r.token_times if t0 <= t < end)
    latency = [r.end - r.start for r in done if r.kind != "control"]
    ttft = [r.first - r.start for r in done if r.first is not None]
    kinds = sorted({r.kind for r in started})
    result = {
        "requests": len(started), "completed": len(done), "errors": len(errors), "rejected_429": len(rejected),
        "disconnected": sum(r.disconnected for r in started), "unfinished": sum(1 for r in records if not r.end),
        "by_kind": {k: sum(r.kind == k for r in done) for k in kinds},
        "latency_s": {"p50": percentile(latency, 50), "p99": percentile(latency, 99)},
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tokens_per_s": tokens / duration, "tokens_per_request": (sum(len(r.token_times) for r in done)
                                                                  / max(1, len(done))),
        "error_samples": sorted({r.error for r in errors})[:5],
        "server": _server(server),
    }
    return result


MONOTONIC = ("_total", "_sum", "_count")     # counters, histograms' sums and counts: they only grow


def parse_metrics(page: str) -> dict[str, float]:
    """A /metrics page's wcodec_generate_* counters and histogram sums and counts, by series (its
    name and labels). Gauges, buckets and `_created` stamps are left out: `window` subtracts these."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("wcodec_generate_"):
            series, value = line.rsplit(" ", 1)
            if series.split("{", 1)[0].endswith(MONOTONIC):
                out[series] = float(value)
    return out


def window(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's view of one run: each series of `after` less its value in `before` (a new
    series from 0; one that fell, a restarted server, from 0 as Prometheus's rate() takes it)."""
    return {k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v for k, v in after.items()}


def _mean(server: dict[str, float], family: str) -> float | None:
    count = sum(v for k, v in server.items() if k.startswith(family + "_count"))
    return sum(v for k, v in server.items() if k.startswith(family + "_sum")) / count if count else None


def _server(m: dict[str, float]) -> dict:
    statuses = {}
    for key, value in m.items():
        if key.startswith("wcodec_generate_requests_total{"):
            status = key.split('status="')[1].split('"')[0]
            statuses[status] = statuses.get(status, 0) + value
    return {"requests": statuses,
            "mean_rows_per_step": _mean(m, "wcodec_generate_batch_size"),
            "mean_tokens_per_step": _mean(m, "wcodec_generate_batch_tokens"),
            "mean_inter_token_latency_s": _mean(m, "wcodec_generate_inter_token_latency_seconds"),
            "mean_ttft_s": _mean(m, "wcodec_generate_time_to_first_token_seconds"),
            "mean_queue_s": _mean(m, "wcodec_generate_queue_duration_seconds"),       # the TTFT's two parts
            "mean_prefill_s": _mean(m, "wcodec_generate_prefill_duration_seconds")}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def text(r: dict) -> str:
    srv = r["server"]
    rows, toks = srv["mean_rows_per_step"], srv["mean_tokens_per_step"]
    lines = [
        f"scenario {r['scenario']}: {r['users']} users, {r['duration_s']:.0f} s, max_new_tokens {r['tokens']}"
        f" ({r['checkout']}{' ' + ' '.join(r['env']) if r['env'] else ''})",
        f"load average before {' '.join(f'{x:.2f}' for x in r['loadavg_before'])}, "
        f"after {' '.join(f'{x:.2f}' for x in r['loadavg_after'])}",
        f"requests   {r['requests']} started, {r['completed']} completed {r['by_kind']}, "
        f"{r['disconnected']} left mid-stream on purpose, {r['rejected_429']} rejected (429)",
        f"errors     {r['errors']}" + (f"  e.g. {r['error_samples'][0]}" if r["error_samples"] else ""),
        f"latency    p50 {_s(r['latency_s']['p50'])}   p99 {_s(r['latency_s']['p99'])}",
        f"TTFT       p50 {_s(r['ttft_s']['p50'])}   p99 {_s(r['ttft_s']['p99'])}",
        f"tokens/s   {r['tokens_per_s']:.1f}   ({r['tokens_per_request']:.1f} tokens per completed request)",
        f"server     {srv['requests']}" + (f", {rows:.1f} rows and {toks:.1f} tokens per step"
                                             if rows and toks else ""),
    ]
    if srv.get("mean_queue_s") is not None and srv.get("mean_prefill_s") is not None:
        lines.append(f"server     TTFT mean {srv['mean_ttft_s'] * 1e3:.1f} ms: queue {srv['mean_queue_s'] * 1e3:.1f} ms"
                     f" + prefill {srv['mean_prefill_s'] * 1e3:.1f} ms")
    return "\n".join(lines)
