"""The label names a PromQL query (a dashboard panel's, an alert's) uses, checked against those the
service's metrics carry: a selector's matchers, an aggregation's `by (...)`, a join's `on (...)`,
and what a legend or an alert's annotation prints. Not a PromQL parser: enough for the queries
under deploy/, where a misspelt or missing label selects nothing, or merges series, silently."""
from __future__ import annotations

import re

TARGET = frozenset({"instance", "job"})          # what Prometheus' scrape adds to every series
SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")
PRINTED = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}|\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)")   # legend, alert


def exposed_labels() -> dict[str, frozenset[str]]:
    """Every sample name the service's registry can expose -> its labels (a bucket's `le` too)."""
    from service.metrics import Metrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    out = {"up": frozenset()}
    for metric in Metrics().registry._collector_to_names:    # labelled metrics without children too
        labels = frozenset(metric._labelnames)
        for s in suffixes[metric._type]:
            out[metric._name + s] = labels | ({"le"} if s == "_bucket" else set())
    return out


def _names(expr: str, known: dict[str, frozenset[str]]) -> list[str]:
    stripped = GROUPING.sub("", re.sub(r'"[^"]*"', '""', expr))
    return [n for n in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", stripped) if n in known]


def _balanced(expr: str, start: int, step: int) -> str:
    """The parenthesised expression whose "(" (step 1) or ")" (step -1) is at `start`."""
    depth, i = 0, start
    while True:
        depth += {"(": step, ")": -step}.get(expr[i], 0)
        if depth == 0:
            return expr[min(start, i):max(start, i) + 1]
        i += step


def _scope(expr: str, m: re.Match) -> str:
    """The expression an aggregation's `by (...)` groups: the parenthesis after it (`sum by (a) (x)`)
    or the one before it (`sum (x) by (a)`)."""
    if expr[m.end():].lstrip().startswith("("):
        return _balanced(expr, expr.index("(", m.end()), 1)
    return _balanced(expr, expr[:m.start()].rstrip().rindex(")"), -1)


def _common(names: list[str], known: dict[str, frozenset[str]]) -> frozenset[str]:
    labels = [known[n] for n in names]
    return TARGET | (frozenset.intersection(*labels) if labels else frozenset())


def output_labels(expr: str, known: dict[str, frozenset[str]]) -> frozenset[str]:
    """The labels a query's result may carry: those its aggregations keep, or (none) its metrics'."""
    kept = [set(re.findall(r"\w+", m.group(2))) for m in GROUPING.finditer(expr) if m.group(1) == "by"]
    return frozenset(set().union(*kept) - {"le"}) if kept else _common(_names(expr, known), known)


def label_problems(expr: str, known: dict[str, frozenset[str]], printed: str = "",
                   added: frozenset[str] = frozenset()) -> list[str]:
    """What in `expr` names a label its metrics lack; `printed`: a legend or annotations that print
    the result's labels (`added`: labels the rule adds, as an alert's severity)."""
    problems = []
    for name, matchers in SELECTOR.findall(expr):
        if name in known:
            problems += [f"{name} has no label {label!r}" for label in MATCHER.findall(matchers)
                         if label not in known[name] | TARGET]
    for m in GROUPING.finditer(expr):
        scope = _scope(expr, m) if m.group(1) in ("by", "without") else expr
        have = _common(_names(scope, known), known)
        problems += [f"{m.group(1)} ({label}) over {sorted(set(_names(scope, known)))}"
                     for label in re.findall(r"\w+", m.group(2)) if label not in have]
    for m in re.finditer(r"\bhistogram_quantile\s*\(", expr):
        kept = [g for g in GROUPING.finditer(_balanced(expr, m.end() - 1, 1)) if g.group(1) in ("by", "without")]
        problems += [f"histogram_quantile over {g.group(0)}: its buckets merged" for g in kept
                     if ("le" in re.findall(r"\w+", g.group(2))) != (g.group(1) == "by")]
    out = output_labels(expr, known) | added
    problems += [f"prints {label!r}, not in the result's {sorted(out)}"
                 for label in (a or b for a, b in PRINTED.findall(printed)) if label not in out]
    return problems
