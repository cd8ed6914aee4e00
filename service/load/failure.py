"""A load that failed: its typed error (`load_error`, carried by `Failed`) and what it must not
keep alive (`forget_frames`). The registry ends the model `failed` with that error (a reload's:
the loaded version serves on) and frees what the load had made before the error is answered."""
from __future__ import annotations

import logging
import traceback

import torch

from codec.errors import CodecError

from ..errors import InsufficientMemory, LoadFailed, ServiceError

log = logging.getLogger("wcodec.service")


def load_error(name: str, e: Exception) -> tuple[ServiceError, str]:
    """The typed error of a failed load, and its wcodec_model_loads_total result."""
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return InsufficientMemory(f"out of memory while loading {name!r}: {e}"), "oom"
    if isinstance(e, InsufficientMemory):              # budget.check_charge
        return e, "oom"
    if isinstance(e, LoadFailed):
        return e, "failed"
    if isinstance(e, CodecError):
        return LoadFailed(f"cannot load {name!r}: {e}"), "failed"
    log.exception("loading %s failed", name)
    return LoadFailed(f"cannot load {name!r}: {type(e).__name__}: {e}"), "failed"


def forget_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames that a failed load's exceptions (and those they
    chain) hold: the tensors it had decoded, its model, would else live as long as the job's
    exception, until the model's next load (and in torch.cuda.memory_allocated, which the budget
    reads, meanwhile). A failed engine close's hold the engine and its KV cache the same way."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__context__


class Failed(Exception):
    """A load that failed, what it had made already freed: its typed error and its
    wcodec_model_loads_total result (`load_error`), for the registry to answer."""

    def __init__(self, error: ServiceError, result: str):
        super().__init__(error.message)
        self.error, self.result = error, result
