"""The host cache (service/load/hostcache.py): a second load of an archive decodes from host memory
without reading the file, bit-exact; a bit flipped in the cached bytes fails the load typed and
drops the entry; the byte budget evicts the least recently used idle entry; a rewritten file is a
miss; a budget of 0 turns it off. Then the same through the model-control API."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from service_helpers import FileReads

from codec.decode import Archive
from decoding import decode_whole
from codec.encode import compress_state_dict
from codec.errors import ChecksumError
from service.load.hostcache import HostCache
from service.load.pipeline import decode_archive
from service.load.reading import align_up
from service.registry import ModelState
from service.settings import Settings

CPU = torch.device("cpu")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(3000, 8, generator=g).bfloat16(),
            "model.layers.0.mlp.weight": torch.randn(70, 90, generator=g),
            "model.layers.0.ids": torch.arange(37, dtype=torch.int32) + seed,
            "model.layers.1.mlp.weight": (torch.randn(5000, generator=g) * 3).half(),
            "model.norm.weight": torch.ones(16, dtype=torch.bfloat16)}


def _archive(path: Path, seed: int = 0) -> Path:
    compress_state_dict(_state(seed), path, workers=1)
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return _archive(tmp_path / "small.wcodec")


def assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _load(cache: HostCache, path: Path, verify: bool = True):
    with cache.use(str(path), verify=verify, threads=2, direct=None) as use:
        return use, decode_archive(path, CPU, early=use.read)


def _stream(path: Path, name: str, role: str) -> dict:
    with Archive.open(path) as archive:
        return next(e for e in archive.entries if e.name == name).streams[role]


def _freed(read, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not read.buf.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    return read.buf.closed


def test_a_second_load_hits_and_reads_no_file(small: Path, monkeypatch) -> None:
    reads = FileReads(monkeypatch)
    cache = HostCache(1 << 30, pin=False)
    use, cold = _load(cache, small)
    kept = cache.peek(str(small))
    assert (use.looked, use.hit, use.source) == (True, False, "file") and use.read is kept
    assert reads.bytes >= kept.nbytes > 0 and len(cache) == 1 and cache.nbytes == kept.mapped_bytes
    reads.opened.clear()
    reads.bytes = 0
    use, warm = _load(cache, small)
    assert (use.looked, use.hit, use.source) == (True, True, "host cache") and use.read is kept
    assert reads.opened == [] and reads.bytes == 0                       # not a byte of the file
    assert_same(warm.tensors, cold.tensors)
    assert_same(warm.tensors, decode_whole(small))
    assert not kept.buf.closed and len(cache) == 1                       # still kept after the hit
    cache.clear()
    assert len(cache) == 0 and _freed(kept)


@pytest.mark.parametrize("verify", [True, False])
def test_a_flipped_bit_in_the_cache_fails_typed_and_drops_the_entry(small: Path, verify: bool) -> None:
    cache = HostCache(1 << 30, pin=False)
    _load(cache, small)
    kept = cache.peek(str(small))
    rec = _stream(small, "model.layers.1.mlp.weight", "hi")
    kept.view[rec["offset"] + 5 - kept.base] ^= 0x40                     # host RAM goes bad
    if not verify:                                                       # checks off: nothing notices
        use, decoded = _load(cache, small, verify=False)
        assert use.hit and not torch.equal(decoded.tensors["model.layers.1.mlp.weight"],
                                           decode_whole(small)["model.layers.1.mlp.weight"])
        return
    with pytest.raises(ChecksumError, match="model.layers.1.mlp.weight.*stream hi"):
        _load(cache, small)
    assert len(cache) == 0 and cache.peek(str(small)) is None and _freed(kept)
    use, decoded = _load(cache, small)                                   # read from the file again
    assert use.source == "file" and not use.hit and len(cache) == 1
    assert_same(decoded.tensors, decode_whole(small))


def test_the_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    paths = [_archive(tmp_path / f"{name}.wcodec", seed) for seed, name in enumerate("abc")]
    size = max(align_up(p.stat().st_size) for p in paths)
    cache = HostCache(2 * size, pin=False)
    a, b, c = paths
    _load(cache, a)
    _load(cache, b)
    assert _load(cache, a)[0].hit                                         # a is now the most recent
    evicted = cache.peek(str(b))
    use, decoded = _load(cache, c)
    assert not use.hit and cache.peek(str(b)) is None and _freed(evicted)
    assert cache.peek(str(a)) is not None and cache.peek(str(c)) is not None
    assert len(cache) == 2 and cache.nbytes <= 2 * size
    assert_same(decoded.tensors, decode_whole(c))


def test_an_entry_in_use_is_never_evicted(tmp_path: Path) -> None:
    a, b = _archive(tmp_path / "a.wcodec", 0), _archive(tmp_path / "b.wcodec", 1)
    cache = HostCache(max(align_up(p.stat().st_size) for p in (a, b)), pin=False)
    with cache.use(str(a), verify=True, threads=2, direct=None) as loading_a:
        use, decoded = _load(cache, b)                                   # the budget is a's, mid-load
        assert use.looked and not use.hit and use.read is None and cache.peek(str(b)) is None
        decode_archive(a, CPU, early=loading_a.read)
    assert_same(decoded.tensors, decode_whole(b))
    assert cache.peek(str(a)) is loading_a.read and len(cache) == 1
    assert _load(cache, a)[0].hit


def test_a_rewritten_file_is_a_miss(small: Path) -> None:
    cache = HostCache(1 << 30, pin=False)
    _load(cache, small)
    stale = cache.peek(str(small))
    _archive(small, seed=7)                                              # new bytes, size and mtime
    use, decoded = _load(cache, small)
    assert use.looked and not use.hit and _freed(stale)
    assert_same(decoded.tensors, decode_whole(small))
    assert torch.equal(decoded.tensors["model.layers.0.ids"], torch.arange(37, dtype=torch.int32) + 7)
    os.utime(small, ns=(time.time_ns(), time.time_ns() + 10**9))         # only the mtime: a miss too
    assert not _load(cache, small)[0].hit and _load(cache, small)[0].hit and len(cache) == 1


def test_a_budget_of_0_turns_it_off(small: Path, monkeypatch) -> None:
    reads = FileReads(monkeypatch)
    cache = HostCache(0, pin=False)
    for _ in range(2):
        use, decoded = _load(cache, small)
        assert (use.read, use.looked, use.source) == (None, False, "file")
    assert len(cache) == 0 and cache.nbytes == 0 and len(reads.opened) == 2
    assert Settings(host_cache_bytes=0).host_cache_budget() == 0
    assert Settings().host_cache_budget() > 0                            # a quarter of the available memory


def test_a_start_up_read_is_kept_instead_of_a_new_one(small: Path, monkeypatch) -> None:
    from service.load.early_read import EarlyRead
    from service.timeline import Timeline
    early = EarlyRead(str(small), verify=True, threads=2, direct=None, timeline=Timeline())
    reads = FileReads(monkeypatch)
    cache = HostCache(1 << 30, pin=False)
    with cache.use(str(small), verify=True, threads=2, direct=None, early=early) as use:
        decode_archive(small, CPU, early=use.read)
    assert use.read is early and use.source == "early read" and cache.peek(str(small)) is early
    assert reads.opened == [] and not early.buf.closed
    use, decoded = _load(cache, small)
    assert use.hit and use.read is early and reads.opened == []
    assert_same(decoded.tensors, decode_whole(small))


def test_an_archive_over_the_budget_is_not_kept(small: Path) -> None:
    cache = HostCache(small.stat().st_size // 2, pin=False)
    use, decoded = _load(cache, small)
    assert use.looked and use.read is None and len(cache) == 0
    assert_same(decoded.tensors, decode_whole(small))


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister as a CPU-only test sees them: what is locked, and a
    failure on the `fail_at`-th call (2: cudaErrorMemoryAllocation)."""

    def __init__(self, fail_at: int | None = None):
        self.locked: dict[int, int] = {}
        self.calls, self.fail_at = 0, fail_at

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls += 1
        if self.calls == self.fail_at:
            return 2
        self.locked[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        del self.locked[address]
        return 0


def _until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_kept_bytes_are_page_locked_in_one_registration_and_unlocked_when_evicted(small: Path,
                                                                                  monkeypatch) -> None:
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    cache = HostCache(1 << 30, pin=True)
    _load(cache, small)
    kept = cache.peek(str(small))
    assert _until(lambda: kept.pinned) and cache.pinned_bytes == cache.nbytes == kept.mapped_bytes
    assert list(rt.locked.values()) == [kept.mapped_bytes] and rt.calls == 1     # a copy never spans two
    use, decoded = _load(cache, small)
    assert use.hit and use.read.pinned
    assert_same(decoded.tensors, decode_whole(small))
    cache.clear()
    assert _until(lambda: not rt.locked) and _freed(kept) and not kept.pinned


def test_a_failed_page_lock_leaves_nothing_locked_and_hits_still_work(small: Path, monkeypatch) -> None:
    rt = FakeCudart(fail_at=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    cache = HostCache(1 << 30, pin=True)
    _load(cache, small)
    kept = cache.peek(str(small))
    assert _until(lambda: rt.calls >= 1 and not rt.locked) and not kept.pinned and cache.pinned_bytes == 0
    use, decoded = _load(cache, small)
    assert use.hit and rt.calls == 1                                     # no second try
    assert_same(decoded.tensors, decode_whole(small))


# --- through the model-control API -------------------------------------------------------------

@pytest.fixture
def tiny_store(tmp_path: Path, tiny_archive: Path):
    def make(*names: str) -> Path:
        root = tmp_path / "store"
        root.mkdir(exist_ok=True)
        for name in names:
            os.link(tiny_archive, root / f"{name}.wcodec")
        return root
    return make


def _weights(server, name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in server.registry.get(name).served.model.state_dict().items()}


@pytest.mark.anyio
async def test_a_model_switch_hits_the_host_cache(serve, tiny_store, monkeypatch) -> None:
    async with serve(tiny_store("tiny")) as server:
        c = server.client
        first = (await c.post("/models/tiny/load")).json()
        assert first["state"] == "ready" and first["last_load"]["source"] == "file"
        cold = _weights(server, "tiny")
        kept = server.registry.host_cache.peek(str(server.registry.get("tiny").file.path))
        assert await server.metric("wcodec_host_cache_bytes") == kept.mapped_bytes > 0
        assert await server.metric("wcodec_host_cache_entries") == 1
        assert (await c.post("/models/tiny/unload")).json()["state"] == "available"
        reads = FileReads(monkeypatch)
        again = (await c.post("/models/tiny/load")).json()
        assert again["state"] == "ready" and again["last_load"]["source"] == "host cache"
        assert reads.bytes == 0 and reads.opened == []
        assert_same(_weights(server, "tiny"), cold)
        assert await server.metric("wcodec_host_cache_hits_total", model="tiny") == 1
        assert await server.metric("wcodec_host_cache_misses_total", model="tiny") == 1
        r = await c.post("/generate", json={"inputs": "What is", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200


@pytest.mark.anyio
async def test_a_flipped_bit_in_the_cache_fails_the_load_and_leaves_it_unloaded(serve, tiny_store) -> None:
    async with serve(tiny_store("tiny")) as server:
        c = server.client
        assert (await c.post("/models/tiny/load")).status_code == 200
        await c.post("/models/tiny/unload")
        path = server.registry.get("tiny").file.path
        kept = server.registry.host_cache.peek(str(path))
        rec = _stream(path, "model.layers.1.mlp.down_proj.weight", "hi")
        kept.view[rec["offset"] - kept.base] ^= 0x01
        r = await c.post("/models/tiny/load")
        assert r.status_code == 500 and r.json()["error_type"] == "load_failed", r.text
        assert "model.layers.1.mlp.down_proj.weight" in r.json()["error"] and "checksum" in r.json()["error"]
        info = (await c.get("/models/tiny")).json()
        assert info["state"] == "failed" and server.registry.get("tiny").served is None
        assert len(server.registry.host_cache) == 0 and await server.metric("wcodec_host_cache_bytes") == 0
        assert await server.metric("wcodec_model_loads_total", model="tiny", result="failed") == 1
        again = (await c.post("/models/tiny/load")).json()                 # from the file: good again
        assert again["state"] == "ready" and again["last_load"]["source"] == "file"
        assert await server.metric("wcodec_host_cache_misses_total", model="tiny") == 2


@pytest.mark.anyio
async def test_two_models_and_a_budget_for_one(serve, tiny_store, tiny_archive) -> None:
    async with serve(tiny_store("a", "b"), host_cache_bytes=align_up(tiny_archive.stat().st_size)) as server:
        c = server.client

        async def switch_to(name: str) -> str:
            source = (await c.post(f"/models/{name}/load")).json()["last_load"]["source"]
            assert (await c.post(f"/models/{name}/unload")).json()["state"] == "available"
            return source
        assert [await switch_to(n) for n in "aabba"] == ["file", "host cache", "file", "host cache", "file"]
        assert len(server.registry.host_cache) == 1 and await server.metric("wcodec_host_cache_entries") == 1
        assert await server.metric("wcodec_host_cache_hits_total", model="a") == 1
        assert await server.metric("wcodec_host_cache_misses_total", model="a") == 2
        assert server.registry.get("a").state is ModelState.AVAILABLE


@pytest.mark.anyio
async def test_host_cache_off(serve, tiny_store) -> None:
    async with serve(tiny_store("tiny"), host_cache_bytes=0) as server:
        for _ in range(2):
            info = (await server.client.post("/models/tiny/load")).json()
            assert info["last_load"]["source"] == "file"
            await server.client.post("/models/tiny/unload")
        assert len(server.registry.host_cache) == 0
        assert await server.metric("wcodec_host_cache_hits_total", model="tiny") == 0
        assert await server.metric("wcodec_host_cache_misses_total", model="tiny") == 0
