"""A model of the registry (`ModelEntry`): its state, what its load made, its memory as charged, its
job; the requests in flight on one loaded version (`Requests`) and a request's reference on a ready
one (`Lease`). The registry (registry.py) moves the states; this file holds the records."""
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
class Requests:
    """The requests in flight on one loaded version of a model: a reload swaps in a new one, and
    the replaced version closes once its own are done (`idle`)."""
    count: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


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
    overlap_bytes: int = 0                     # a reload's other versions: the new one loading, old ones draining
    requests: Requests = field(default_factory=Requests)     # the serving version's
    job: asyncio.Task | None = None
    retiring: set[asyncio.Task] = field(default_factory=set)  # replaced versions draining, then closing

    @property
    def name(self) -> str:
        return self.file.name

    @property
    def in_flight(self) -> int:
        return self.requests.count

    @property
    def idle(self) -> asyncio.Event:
        return self.requests.idle

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done()


class Lease:
    """A reference on the version of a ready model that serves one request: a reload meanwhile
    leaves it that version, open until its last lease goes; `release()` is idempotent."""

    def __init__(self, entry: ModelEntry):
        self.entry, self._held, self._requests = entry, True, entry.requests
        self._requests.count += 1
        self._requests.idle.clear()
        entry.last_used = time.monotonic()
        self.served, self.engine = entry.served, entry.engine

    def release(self) -> None:
        if self._held:
            self._held = False
            self._requests.count -= 1
            self.entry.last_used = time.monotonic()
            if self._requests.count == 0:
                self._requests.idle.set()
