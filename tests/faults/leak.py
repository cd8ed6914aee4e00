"""The leak check: load -> generate (2 tokens) -> unload, repeated, and the server's resident
memory after each cycle. The promise (issue 12): after the first few cycles an unloaded model
gives its memory back, so RSS after the last cycle <= RSS after cycle 5 + 64 MiB."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .server import ServerProcess
from .storm import PROMPTS

BOUND = 64 << 20
BASE_CYCLE = 5


@dataclass
class LeakReport:
    cycles: int = 0
    rss: list[int] = field(default_factory=list)        # bytes after cycle 1, 2, ...

    @property
    def growth(self) -> int:
        """RSS after the last cycle minus RSS after cycle 5."""
        return self.rss[-1] - self.rss[BASE_CYCLE - 1]

    def summary(self) -> dict:
        mb = [round(r / 2**20) for r in self.rss]
        return {"cycles": self.cycles, "rss_mb_after_cycle": {i + 1: m for i, m in enumerate(mb)
                                                               if i + 1 in (1, BASE_CYCLE) or (i + 1) % 10 == 0
                                                               or i + 1 == self.cycles},
                "min_mb": min(mb), "max_mb": max(mb), "growth_after_cycle_5_mb": round(self.growth / 2**20, 1),
                "bound_mb": BOUND >> 20}


def run_cycles(server: ServerProcess, model: str, cycles: int,
               on_cycle: Callable[[int, int], None] = lambda i, rss: None) -> LeakReport:
    report = LeakReport()
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for i in range(1, cycles + 1):
            assert http.post(f"/models/{model}/load").status_code == 200
            r = http.post("/generate", json={"inputs": PROMPTS[0], "model": model,
                                             "parameters": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
            assert http.post(f"/models/{model}/unload").json()["state"] == "available"
            report.rss.append(server.rss())
            report.cycles = i
            on_cycle(i, report.rss[-1])
    return report
