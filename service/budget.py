"""The memory budget (WCODEC_GPU_MEMORY_BUDGET, bytes): which idle models a load evicts.

Used memory is the weight bytes of the resident models as held (their `weight_bytes`: a load's
estimate from the header while it runs, every buffer the load makes included, then the figure the
metrics report, which is no more: `check_charge`), or
`torch.cuda.memory_allocated` when that is larger (on CUDA): the registry sums it. Before a load,
the least recently used idle ready models are unloaded until the new one fits; if even all of
them cannot make it fit, nothing is unloaded and the load is refused (507)."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from .errors import InsufficientMemory

log = logging.getLogger("wcodec.service")


class Resident(Protocol):
    name: str
    weight_bytes: int
    last_used: float


def evictions(name: str, need: int, used: int, budget: int | None, idle: Iterable[Resident]) -> list[Resident]:
    """The idle models to unload, least recently used first, so that `need` more bytes fit beside
    `used`: none when they fit already; InsufficientMemory when unloading every one would not do."""
    if budget is None or used + need <= budget:
        return []
    freed, victims = 0, []
    for other in sorted(idle, key=lambda e: e.last_used):
        victims.append(other)
        freed += other.weight_bytes
        if used - freed + need <= budget:
            return victims
    raise InsufficientMemory(f"model {name!r} needs {need} bytes; {used} of the budget of {budget} "
                             f"bytes are in use and unloading idle models frees only {freed}")


def check_charge(name: str, estimate: int, real: int, others: int, budget: int | None) -> None:
    """A load's own bytes against the estimate charged before it, which counts every buffer the
    load makes (Loader.estimate_bytes), so more is an estimate's bug: logged as an error, and
    InsufficientMemory (507; the failed load's path gives its memory back) where the budget cannot
    hold it beside the `others` bytes charged, so that no load leaves the budget exceeded. One that
    fits is kept: a model that fits refused for a wrong estimate would be an outage."""
    if real <= estimate:
        return
    log.error("load of %s took %d weight bytes, %d more than the estimate charged before it: "
              "Loader.estimate_bytes misses a buffer", name, real, real - estimate)
    if budget is not None and others + real > budget:
        raise InsufficientMemory(f"model {name!r} took {real} bytes, more than its estimate of {estimate}, and "
                                 f"{others} of the budget of {budget} bytes are charged to other models")
