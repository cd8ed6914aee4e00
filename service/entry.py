"""A model of the registry (`ModelEntry`): its state, what its load made, its memory as charged, its
job; and a request's reference on a ready one (`Lease`). The registry (registry.py) moves the
states; this file holds the records."""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from .engine import Engine
from .load.job import LoadStats, Progress
from .load.store import ModelFile
from .model.build import ServedModel


class ModelState(str, enum.Enum):
    AVAILABLE = "available"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


HOLDS_MEMORY = (ModelState.LOADING, ModelState.READY, ModelState.UNLOADING)   # states with weights on the device


@dataclass
class ModelEntry:
    file: ModelFile
    state: ModelState = ModelState.AVAILABLE
    progress: Progress = field(default_factory=Progress)
    served: ServedModel | None = None
    engine: Engine | None = None
    stats: LoadStats | None = None
    loaded_at: float | None = None             # wall-clock time of the last successful load
    last_error: str | None = None
    last_used: float = 0.0                     # monotonic; orders eviction
    reserved_bytes: int = 0                    # CUDA: allocator reserve taken by its load
    weights: str = "decoded"                   # how its weights are held: "decoded" or "compressed"
    weight_bytes: int = 0                      # device bytes of its weights as held (an estimate while loading)
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    job: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def name(self) -> str:
        return self.file.name

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done()


class Lease:
    """A reference on a ready model for one request; `release()` is idempotent."""

    def __init__(self, entry: ModelEntry):
        self.entry, self._held = entry, True
        entry.in_flight += 1
        entry.idle.clear()
        entry.last_used = time.monotonic()
        self.served, self.engine = entry.served, entry.engine

    def release(self) -> None:
        if self._held:
            self._held = False
            self.entry.in_flight -= 1
            self.entry.last_used = time.monotonic()
            if self.entry.in_flight == 0:
                self.entry.idle.set()
