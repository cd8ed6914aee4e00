"""The service on a GPU: the pipelined CUDA loader (copy and compute streams) is bit-exact and
verifies every stream's CRC32 on the GPU (none on the host), a host cache hit copies from
page-locked memory without the ring, and a load, a generate and an unload leave CUDA memory
where it started. Skipped without a GPU."""
from __future__ import annotations

import asyncio
import gc
import os
import time
from pathlib import Path

import pytest
import torch

import cuda_ext
from codec.decode import Archive
from codec.errors import ChecksumError
from service.load.pipeline import decode_archive
from service.registry import ModelState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TINY_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(autouse=True)
def cuda_decoder() -> None:
    if not cuda_ext.available().cuda:
        pytest.skip(f"CUDA decoder unavailable: {cuda_ext.available().reason}")


def same_answer(a: dict, b: dict) -> bool:
    """The same text and tokens, and logprobs within what the two kernel paths give: a load's first
    steps run the modules' kernels until Triton's, warmed on a thread beside serving, are adopted
    (service/engine/runner.py), so which of a request's steps ran which depends on timing (on an
    H200 two answers' logprobs parted in low bits, 2026-11-28). A wrong weight moves the tokens."""
    ta, tb = a["details"]["tokens"], b["details"]["tokens"]
    return (a["generated_text"] == b["generated_text"] and [(t["id"], t["text"]) for t in ta] == [(t["id"], t["text"]) for t in tb]
            and all(abs(x["logprob"] - y["logprob"]) <= 0.05 for x, y in zip(ta, tb)))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("ring", [2, 3])
def test_cuda_pipeline_is_bit_exact(tiny_archive: Path, ring: int) -> None:
    ref = decode_archive(tiny_archive, torch.device("cpu")).tensors
    got = decode_archive(tiny_archive, torch.device("cuda"), ring=ring)
    assert got.stats.h2d_s > 0 and got.stats.batches == 4
    assert set(got.tensors) == set(ref)
    for name, t in ref.items():
        assert got.tensors[name].is_cuda and torch.equal(_bytes(got.tensors[name]), _bytes(t)), name


def _a_stream(path: Path) -> tuple[str, dict]:
    """The largest coded stream of an archive: (what the loader calls it, its record)."""
    with Archive.open(path) as archive:
        return max(((f"tensor {e.name!r}: stream {role}", rec) for e in archive.entries
                    for role, rec in e.streams.items()), key=lambda item: item[1]["length"])


def _host_hashes(monkeypatch) -> list:
    from service.load import reading
    calls, fault = [], reading.checksum_fault
    monkeypatch.setattr(reading, "checksum_fault", lambda data, record: calls.append(1) or fault(data, record))
    return calls


def test_streams_are_verified_on_the_gpu_not_the_host(tiny_archive: Path, tmp_path: Path, monkeypatch) -> None:
    hashes = _host_hashes(monkeypatch)
    good = decode_archive(tiny_archive, torch.device("cuda"))
    assert hashes == [] and good.stats.batches == 4
    what, rec = _a_stream(tiny_archive)
    bad = tmp_path / "bad.wcodec"
    data = bytearray(tiny_archive.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0x04                     # the record's CRC32 left as it was
    bad.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=f"{bad}.*{what}.*CRC32.*GPU") as e:
        decode_archive(bad, torch.device("cuda"))
    assert "\n" not in str(e.value)


def test_pinned_ring_is_kept_and_reused_by_later_loads(tiny_archive: Path) -> None:
    """The second load page-locks nothing new: it takes the first one's buffers, and decodes the same."""
    from service.load import pipeline
    first = decode_archive(tiny_archive, torch.device("cuda"), ring=3)
    kept = sorted(b.data_ptr() for b in pipeline.PINNED._free)
    again = decode_archive(tiny_archive, torch.device("cuda"), ring=3)
    assert len(kept) >= 3 and sorted(b.data_ptr() for b in pipeline.PINNED._free) == kept
    assert all(b.is_pinned() for b in pipeline.PINNED._free)
    for name, t in first.tensors.items():
        assert torch.equal(_bytes(again.tensors[name]), _bytes(t)), name


def test_a_host_cache_hit_copies_from_page_locked_memory(tiny_archive: Path, monkeypatch) -> None:
    """Once the kept archive is page-locked, a hit takes no ring buffer: each batch is copied to
    the device straight from the cached pages, verified again, bit-exact."""
    from service.load import pipeline
    from service.load.hostcache import HostCache
    cache, cuda = HostCache(1 << 30, pin=True), torch.device("cuda")
    with cache.use(str(tiny_archive), verify=True, threads=4, direct=None) as use:
        first = decode_archive(tiny_archive, cuda, early=use.read)
    kept = cache.peek(str(tiny_archive))
    deadline = time.monotonic() + 30
    while not kept.pinned and time.monotonic() < deadline:
        time.sleep(0.01)
    probe = torch.frombuffer(kept.view, dtype=torch.uint8, count=64)
    assert kept.pinned and probe.is_pinned() and cache.pinned_bytes == cache.nbytes > 0
    del probe
    taken, take = [], pipeline.PINNED.take
    monkeypatch.setattr(pipeline.PINNED, "take", lambda n, nbytes: taken.append(n) or take(n, nbytes))
    with cache.use(str(tiny_archive), verify=True, threads=4, direct=None) as use:
        again = decode_archive(tiny_archive, cuda, early=use.read)
    assert use.hit and taken == [0] and again.stats.h2d_s > 0
    for name, t in first.tensors.items():
        assert torch.equal(_bytes(again.tensors[name]), _bytes(t)), name
    what, rec = _a_stream(tiny_archive)
    kept.view[rec["offset"] + 3 - kept.base] ^= 0x80                     # page-locked host RAM goes bad
    with pytest.raises(ChecksumError, match=f"{what}.*GPU"):
        with cache.use(str(tiny_archive), verify=False, threads=4, direct=None) as use:
            decode_archive(tiny_archive, cuda, early=use.read)
    assert use.hit and len(cache) == 0                                   # the entry is dropped
    cache.clear()


@pytest.mark.anyio
async def test_load_generate_unload_returns_cuda_memory(serve, tmp_path: Path, tiny_archive: Path) -> None:
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    async with serve(tmp_path / "store") as server:
        r = await server.client.post("/models/tiny/load")
        assert r.status_code == 200 and r.json()["device"] == "cuda", r.text
        assert r.json()["last_load"]["h2d_s"] > 0
        assert await server.metric("wcodec_gpu_memory_allocated_bytes") > baseline
        decoded = r.json()["decoded_bytes"]
        assert await server.metric("wcodec_model_memory_allocated_bytes", model="tiny", device="cuda") == decoded
        body = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8}}
        rs = [await server.client.post("/generate", json=body) for _ in range(2)]
        assert [r.status_code for r in rs] == [200, 200] and same_answer(rs[0].json(), rs[1].json())
        assert (await server.client.post("/models/tiny/unload")).json()["state"] == "available"
        assert server.registry.get("tiny").state is ModelState.AVAILABLE
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == baseline


@pytest.mark.anyio
async def test_a_model_switch_on_cuda_comes_from_the_host_cache(serve, tmp_path: Path, tiny_archive: Path) -> None:
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    body = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8}}
    async with serve(tmp_path / "store") as server:
        answers = []
        for source in ("file", "host cache", "host cache"):
            r = await server.client.post("/models/tiny/load")
            assert r.status_code == 200 and r.json()["last_load"]["source"] == source, r.text
            answers.append((await server.client.post("/generate", json=body)).json())
            assert (await server.client.post("/models/tiny/unload")).json()["state"] == "available"
        assert same_answer(answers[0], answers[1]) and same_answer(answers[0], answers[2])
        assert await server.metric("wcodec_host_cache_hits_total", model="tiny") == 2


@pytest.mark.anyio
async def test_an_untied_table_stays_on_the_host_in_compressed_mode(serve, tmp_path: Path,
                                                                     untied_tiny_archive: Path) -> None:
    """Compressed mode on CUDA keeps an untied embedding table page-locked on the host: the load's
    weight_bytes leave it out, wcodec_model_host_weight_bytes counts it, decoded mode's answer is
    given, and an unload sets both gauges back to 0."""
    from service.model import fixed
    (tmp_path / "store").mkdir()
    os.link(untied_tiny_archive, tmp_path / "store" / "tiny.wcodec")
    with Archive.open(untied_tiny_archive) as archive:
        table = next(e.nbytes for e in archive.entries if e.name == fixed.EMBEDDING)
    body = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8}}
    async with serve(tmp_path / "store") as server:
        c, answers = server.client, {}
        for weights in ("decoded", "compressed"):
            r = await c.post("/models/tiny/load", params={"weights": weights})
            assert r.status_code == 200 and r.json()["device"] == "cuda" and r.json()["weights"] == weights, r.text
            held = r.json()["weight_bytes"]
            assert r.json()["host_weight_bytes"] == (table if weights == "compressed" else 0)
            assert await server.metric("wcodec_model_weight_bytes", model="tiny", weights=weights) == held
            host = await server.metric("wcodec_model_host_weight_bytes", model="tiny")
            assert host == (table if weights == "compressed" else 0)
            answers[weights] = (await c.post("/generate", json=body)).json()
            assert (await c.post("/models/tiny/unload")).json()["state"] == "available"
            assert await server.metric("wcodec_model_host_weight_bytes", model="tiny") == 0
            assert await server.metric("wcodec_model_weight_bytes", model="tiny", weights=weights) == 0
        assert same_answer(answers["decoded"], answers["compressed"])


@pytest.mark.anyio
async def test_the_idle_engine_captures_a_graph_of_every_step_shape(serve, tmp_path: Path, tiny_archive: Path) -> None:
    """wcodec_engine_cuda_graph_shapes gives the decode step shapes the paged engine captures while
    idle; wcodec_engine_cuda_graphs reaches it after a request (the bench waits on this), and an
    unload sets both back to 0."""
    import anyio
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    async with serve(tmp_path / "store") as server:
        assert (await server.client.post("/models/tiny/load")).status_code == 200
        body = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 4}}
        assert (await server.client.post("/generate", json=body)).status_code == 200
        shapes = await server.metric("wcodec_engine_cuda_graph_shapes", model="tiny")
        runner = server.registry.get("tiny").engine._runner
        assert shapes == len(runner.shapes()) > 1
        with anyio.fail_after(120):
            while await server.metric("wcodec_engine_cuda_graphs", model="tiny") < shapes:
                await anyio.sleep(0.2)
        assert (await server.client.post("/models/tiny/unload")).json()["state"] == "available"
        for name in ("wcodec_engine_cuda_graphs", "wcodec_engine_cuda_graph_shapes"):
            assert await server.metric(name, model="tiny") == 0


@pytest.mark.anyio
async def test_two_models_capture_and_serve_side_by_side(serve, tmp_path: Path, tiny_archive: Path,
                                                         untied_tiny_archive: Path, caplog) -> None:
    """Two models on one GPU: each engine captures its step shapes on its own stream while the
    other serves (they shared torch.cuda.graph's one default stream: a capture began on a stream
    already capturing, one model's request failed and the other's graphs were dropped). Every
    answer is 200 and each model's is the one it gives alone; both capture every shape."""
    import anyio
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "a.wcodec")
    os.link(untied_tiny_archive, tmp_path / "store" / "b.wcodec")
    body = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}
    async with serve(tmp_path / "store") as server:
        alone = {}
        for name in ("a", "b"):
            assert (await server.client.post(f"/models/{name}/load")).status_code == 200
            alone[name] = (await server.client.post("/generate", json={**body, "model": name})).json()
        for _ in range(6):                       # while both capture their shapes, idle between requests
            rs = await asyncio.gather(*(server.client.post("/generate", json={**body, "model": n}) for n in "abab"))
            assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
            assert all(same_answer(r.json(), alone[n]) for r, n in zip(rs, "abab"))
        with anyio.fail_after(120):
            for name in ("a", "b"):
                shapes = await server.metric("wcodec_engine_cuda_graph_shapes", model=name)
                while await server.metric("wcodec_engine_cuda_graphs", model=name) < shapes:
                    await anyio.sleep(0.2)
        assert not [r for r in caplog.records if "capturing a decode step failed" in r.getMessage()]


@pytest.mark.anyio
async def test_top_n_tokens_on_cuda(serve, tmp_path: Path, tiny_archive: Path) -> None:
    """top_n_tokens on CUDA, where greedy steps are launched ahead from the graphs' picks: a row
    asking for alternatives takes the steps that wait for their logits, gets the tokens a plain
    request gets, and each token's alternatives most likely first, the first the token itself;
    beside a plain request both complete."""
    import asyncio
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    plain = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8}}
    top = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8, "top_n_tokens": 3}}
    async with serve(tmp_path / "store") as server:
        c = server.client
        assert (await c.post("/models/tiny/load")).status_code == 200
        alone, with_top = (await c.post("/generate", json=plain)).json(), (await c.post("/generate", json=top)).json()
        assert same_answer(alone, with_top) and alone["details"]["top_tokens"] == []
        tokens, alternatives = with_top["details"]["tokens"], with_top["details"]["top_tokens"]
        assert len(alternatives) == len(tokens) >= 1
        for token, alts in zip(tokens, alternatives):
            assert len(alts) == 3 and [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts), reverse=True)
            assert alts[0]["id"] == token["id"] and abs(alts[0]["logprob"] - token["logprob"]) < 1e-6
        both = await asyncio.gather(c.post("/generate", json=top), c.post("/generate", json=plain))
        assert [r.status_code for r in both] == [200, 200]
        details = both[0].json()["details"]
        assert len(details["top_tokens"]) == details["generated_tokens"] >= 1 and both[1].json()["details"]["tokens"]


@pytest.mark.anyio
async def test_logit_bias_and_penalties_on_cuda(serve, tmp_path: Path, tiny_archive: Path) -> None:
    """OpenAI's logit_bias and presence/frequency penalties on CUDA (the bias added and the counts
    taken on the device, the row's steps waiting for their logits): +100 makes every token the
    biased one, -100 bans greedy's first token, and the penalties leave no token repeated more
    often than greedy decoding repeats it."""
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    async with serve(tmp_path / "store") as server:
        c = server.client
        assert (await c.post("/models/tiny/load")).status_code == 200
        plain = (await c.post("/generate", json={"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8}})).json()
        ids = [t["id"] for t in plain["details"]["tokens"]]

        async def tokens(**extra) -> list[str]:
            body = {"model": "tiny", "prompt": TINY_PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, **extra}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]
        base = await tokens()
        forced = await tokens(logit_bias={str(ids[0]): 100})
        assert len(set(forced)) == 1 and forced[0] == base[0]
        assert (await tokens(logit_bias={str(ids[0]): -100}))[0] != base[0]
        curbed = await tokens(presence_penalty=2, frequency_penalty=2)
        assert max(curbed.count(t) for t in curbed) <= max(base.count(t) for t in base)


@pytest.mark.anyio
async def test_typical_p_and_tgi_frequency_penalty_on_cuda(serve, tmp_path: Path, tiny_archive: Path) -> None:
    """TGI's typical_p (the sort and mask on the device) and frequency_penalty (the counts of the
    row's prompt and generated tokens on the device): a seeded typical_p request repeats its
    tokens, and the penalty moves the log-probabilities that the details report (by far more than
    the 1e-3 that two runs of one request may differ by, the step kernels switched in between)."""
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    async with serve(tmp_path / "store") as server:
        c = server.client
        assert (await c.post("/models/tiny/load")).status_code == 200

        async def generate(**parameters) -> dict:
            body = {"inputs": TINY_PROMPT, "parameters": {"max_new_tokens": 8, **parameters}}
            r = await c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()["details"]
        ids = lambda details: [t["id"] for t in details["tokens"]]                   # noqa: E731
        typical = await generate(typical_p=0.5, seed=3)
        assert typical["seed"] == 3 and ids(typical) == ids(await generate(typical_p=0.5, seed=3))
        plain, curbed = await generate(), await generate(frequency_penalty=2.0)
        assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(plain["tokens"], curbed["tokens"])) > 0.05


@pytest.mark.anyio
async def test_prompt_logprobs_on_cuda(serve, tmp_path: Path, tiny_archive: Path) -> None:
    """TGI's decoder_input_details and OpenAI's echo with logprobs on CUDA (the prompt's rows of
    the step, their logits kept): both routes give the same prompt scores, the first null, and
    echo's completion part is the generated tokens' log-probabilities."""
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    async with serve(tmp_path / "store") as server:
        c = server.client
        assert (await c.post("/models/tiny/load")).status_code == 200
        tgi = (await c.post("/generate", json={"inputs": TINY_PROMPT, "parameters": {
            "max_new_tokens": 6, "decoder_input_details": True}})).json()["details"]
        prefill = [t["logprob"] for t in tgi["prefill"]]
        assert prefill[0] is None and all(lp <= 0 for lp in prefill[1:]) and len(prefill) > 3
        body = {"model": "tiny", "prompt": TINY_PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True}
        echo = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        n, got = len(prefill), echo["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == n + len(tgi["tokens"])   # the step kernels may switch between requests:
        close = lambda xs, ys: all(abs(x - y) < 0.05 for x, y in zip(xs, ys, strict=True))    # noqa: E731
        assert close(got[1:n], prefill[1:]) and close(got[n:], [t["logprob"] for t in tgi["tokens"]])


@pytest.mark.anyio
async def test_grammar_and_scoring_on_cuda(serve, tmp_path: Path, tiny_archive: Path) -> None:
    """A regex grammar's mask, and completions' max_tokens 0 with echo (a row of no new tokens), on CUDA."""
    import re
    (tmp_path / "store").mkdir()
    os.link(tiny_archive, tmp_path / "store" / "tiny.wcodec")
    async with serve(tmp_path / "store") as server:
        c = server.client
        assert (await c.post("/models/tiny/load")).status_code == 200
        r = await c.post("/generate", json={"inputs": TINY_PROMPT, "parameters": {
            "max_new_tokens": 8, "grammar": {"type": "regex", "value": "[0-9]{3}"}}})
        assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["generated_text"]), r.text
        ids = [t["id"] for t in (await c.post("/tokenize", json={"inputs": TINY_PROMPT})).json()]
        body = {"model": "tiny", "prompt": TINY_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
        scored = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        assert scored["text"] == TINY_PROMPT and scored["finish_reason"] == "length"
        assert len(scored["logprobs"]["tokens"]) == len(ids) and scored["logprobs"]["token_logprobs"][0] is None


def test_watermark_on_cuda() -> None:
    """The green list drawn by the CUDA generator: on flat logits the pick is its smallest id, and
    a second draw is the same."""
    from types import SimpleNamespace

    from service.engine.logits import greenlist, sample
    from service.engine.sampling import Row, SamplingParams
    cuda = torch.device("cuda")
    served = SimpleNamespace(device=cuda, tokenizer=SimpleNamespace(decode=lambda ids, **_: "x" * len(ids)),
                             eos_ids=frozenset(), special_ids=frozenset())
    row = Row([1, 2, 7], SamplingParams(4, watermark=True), served)
    green = greenlist(7, 1000, cuda)
    assert green.device.type == "cuda" and torch.equal(green, greenlist(7, 1000, cuda)) and len(set(green.tolist())) == 500
    assert sample(torch.zeros(1000, device=cuda), row)[0] == int(green.min())
