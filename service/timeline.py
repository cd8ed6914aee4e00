"""Start-up as one timeline: each phase and each import names itself once, on one time axis whose
zero is the process's own start (the kernel's record of it, so the interpreter's start-up counts).

    timeline.mark("early read: done")              a moment
    with timeline.span("import torch"): ...        an interval (any thread)
    timeline.log(logger)                           every entry, in start order, at debug level

Standard library only: it is the first thing `wcodec serve` makes."""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass


def process_age() -> float:
    """Seconds since this process started (from /proc/self/stat; 0 where there is no /proc)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")      # field 22: start time, clock ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@dataclass(frozen=True)
class Entry:
    name: str
    start: float                   # seconds after the process started
    end: float
    thread: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self) -> None:
        self.origin = time.perf_counter() - process_age()       # perf_counter() at the process's start
        self._entries: list[Entry] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def _add(self, name: str, start: float, end: float) -> None:
        with self._lock:
            self._entries.append(Entry(name, start, end, threading.current_thread().name))

    def mark(self, name: str) -> float:
        t = self.now()
        self._add(name, t, t)
        return t

    @contextmanager
    def span(self, name: str):
        start = self.now()
        try:
            yield
        finally:
            self._add(name, start, self.now())

    def entries(self) -> list[Entry]:
        with self._lock:
            return sorted(self._entries, key=lambda e: (e.start, e.end))

    def first(self, prefix: str) -> Entry | None:
        return next((e for e in self.entries() if e.name.startswith(prefix)), None)

    def as_json(self) -> list[dict]:
        return [{**asdict(e), "seconds": e.seconds} for e in self.entries()]

    def log(self, logger: logging.Logger, title: str = "start-up timeline") -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        lines = [f"{e.start:8.3f} {e.end:8.3f} {e.seconds:7.3f}  {e.name}  [{e.thread}]" for e in self.entries()]
        logger.debug("%s (seconds after the process started: start end duration):\n%s", title, "\n".join(lines))
