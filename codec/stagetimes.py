"""Seconds spent in each stage of `compress`, summed over its batches, per thread: with
WCODEC_TIMINGS=1 in the environment compress prints them on stderr, so that a run on another
machine tells which thread bounds it (reading, encoding or writing) and how long each waits."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "WCODEC_TIMINGS"


class StageTimes:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` timed elsewhere (before this object existed) to stage `name`."""
        with self._lock:
            self.seconds[name] += seconds

    def report(self) -> str:
        lines = {"stages": [(k, v) for k, v in self.seconds.items() if "/" not in k]}
        for key, v in self.seconds.items():
            if "/" in key:
                parent, part = key.split("/", 1)
                lines.setdefault(f"{parent} parts", []).append((part, v))
        return "\n".join(f"compress {what} (s): " + ", ".join(f"{k} {v:.2f}" for k, v in fields)
                         for what, fields in lines.items() if fields)

    def print_if_asked(self) -> None:
        if os.environ.get(ENV) == "1":
            print(self.report(), file=sys.stderr)
