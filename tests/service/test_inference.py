"""inference.py on its own: what happens to a request's generations when its client hangs up."""
from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest

from service import inference
from service.errors import ClientClosed

pytestmark = pytest.mark.anyio


class Generating:
    """An engine request that never ends by itself (a long generation)."""

    def __init__(self):
        self.cancelled = False

    async def result(self):
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class HungUp:
    """The HTTP request of a client that has closed its connection."""

    async def receive(self) -> dict:
        return {"type": "http.disconnect"}


async def test_a_client_that_hangs_up_cancels_its_generations_and_logs_no_error() -> None:
    """finish_all cancels the generations and answers ClientClosed (499); the gather it cancelled
    ended with CancelledError as its exception, which nobody read: asyncio logged an ERROR with a
    traceback ("_GatheringFuture exception was never retrieved") at every hang-up."""
    reported = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
    requests = [Generating(), Generating()]
    try:
        await inference.finish_all([SimpleNamespace(request=r) for r in requests], HungUp())
    except ClientClosed:
        pass
    else:
        raise AssertionError("no ClientClosed")
    for _ in range(5):                           # the cancelled tasks finish, then the gather
        await asyncio.sleep(0)
    gc.collect()
    assert all(r.cancelled for r in requests)
    assert [c["message"] for c in reported] == []
