"""The paged engine (scheduler.py over blocks.py, runner.py, model/paged.py) on the CPU: its greedy
tokens equal the padded engine's (batcher.py, the engine before it) on the demo model, alone and
batched; batched rows equal the same requests alone; a full cache makes requests wait, never fail;
a request larger than the cache is refused; the cache is allocated once."""
from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import weakref

import pytest
import torch
from service_helpers import DEMO
from test_batching import Req, drive, fail_the_prompts_step, first_divergence_is_a_near_tie, load, prompts_of

from cuda_ext import step_kernels
from service.engine import Batcher, Engine, GenRequest, Limits, paging
from service.engine.blocks import BlockManager
from service.engine.inputs import Chunk, Decode
from service.engine.sampling import Row, SamplingParams
from service.engine.worker import paged_engine
from service.errors import QueueFull, ValidationFailed
from service.metrics import Metrics
from service.model import cpu_dtype

PROMPTS = ["What is the capital of France?", "Write a poem about the sea.", "1, 2, 3, 4,",
           "Explain gravity to a child.", "def fib(n):", "The best bread is", "Translate 'cat' into French.",
           "Once upon a time"]


@pytest.fixture(scope="module")
def demo(demo_archive):
    return load(demo_archive, DEMO)


@pytest.fixture(scope="module")
def tiny(tiny_archive):
    return load(tiny_archive, "tiny")


def paged(served, max_rows=64, max_tokens=512, left=None, **cache):
    left = [] if left is None else left
    return paging.scheduler(served, max_rows, max_tokens, paging.CacheSettings(**cache), lambda r, e: None,
                            left.append)


def padded(served, max_rows=64, max_tokens=512):
    return Batcher(served, max_rows=max_rows, max_tokens=max_tokens, on_token=lambda r, e: None,
                   on_finish=lambda r: None)


def generate(engine, rows: list[Row], together: bool) -> list[list[int]]:
    """Every row's tokens: all added at once, or each alone after the one before."""
    for row in rows:
        engine.add(row)
        while not together and not engine.idle:
            engine.step()
    while not engine.idle:
        engine.step()
    return [r.ids for r in rows]


@pytest.mark.parametrize("together", [False, True], ids=["batch1", "batch8"])
def test_demo_greedy_tokens_equal_the_padded_engine(demo, together) -> None:
    """The reference is the padded engine's tokens for each prompt alone: its own batched tokens
    are not batch invariant on every CPU (with AVX512-BF16's dot products, "Explain gravity to a
    child." in a batch of 8 parts from its alone tokens at token 5, where the two top logits are
    one bf16 step apart: 16.625 and 16.5), while the paged engine's are, alone and in the batch,
    where its Linears are batch invariant (linear16, an AVX-512 CPU). Without AVX-512 a bf16
    Linear takes float32 matmuls from 6 rows a call (cpu_dtype's "mixed"), so a row's sums depend
    on its batch: there the batch's tokens may part from them at a near-tie of the two top logits,
    for one prompt at most ("Explain gravity to a child." at token 12 on an AVX2 EPYC, 2026-11-29)."""
    prompts = PROMPTS if together else PROMPTS[:5]
    rows = lambda: [Row(demo.tokenizer.encode(p), SamplingParams(32), demo) for p in prompts]
    ours, theirs = generate(paged(demo), rows(), together), generate(padded(demo), rows(), False)
    if together and not cpu_dtype.linear16_kernel(torch.bfloat16):
        parted = [first_divergence_is_a_near_tie(demo, demo.tokenizer.encode(p), b, a) < len(b)
                  for p, a, b in zip(prompts, ours, theirs)]
        assert sum(parted) <= 1
    else:
        assert ours == theirs


@pytest.mark.skipif(step_kernels.cpu_kernels(torch.device("cpu")) is None, reason="no step ops in the extension")
def test_the_cpu_step_is_the_extensions_ops(tiny, monkeypatch) -> None:
    """On the CPU the paged engine's step runs cuda_ext/csrc/step_cpu.cpp's ops, so the greedy
    comparisons here test them; WCODEC_CPU_STEP=0: the modules."""
    assert paged(tiny).runner.fused is step_kernels.cpu_kernels(torch.device("cpu"))
    monkeypatch.setenv("WCODEC_CPU_STEP", "0")
    assert paged(tiny).runner.fused is None


def test_batched_rows_equal_alone(tiny) -> None:
    """Arrivals at different steps, chunked prompts, a cancellation, rows waiting for a free row
    and for blocks; every row's tokens equal its tokens alone (or part at a near-tie)."""
    rng = random.Random(1)
    prompts = [p for p in prompts_of(tiny, 20, rng) if len(p) <= 100][:12]
    reqs = [Req(p, SamplingParams(rng.randint(1, 12)), arrive=rng.randint(0, 15)) for p in prompts]
    reqs[3].cancel_at = reqs[3].arrive + 2
    left: list[Row] = []
    per = paging.paged.PagedCache.token_bytes(tiny.model.config, paging.cache_dtype(tiny))
    s = paged(tiny, max_rows=6, max_tokens=48, left=left, nbytes=per * 300)   # two or three requests' worth
    def check(_):
        assert s.blocks.used == sum(len(q.table) for q in s.running + s.prefilling)

    rows = drive(s, tiny, reqs, check)
    assert s.blocks.used == 0 and sorted(map(id, left)) == sorted(map(id, rows))
    for req, row in zip(reqs, rows):
        (alone,) = [Row(req.prompt, req.params, tiny)]
        generate(paged(tiny), [alone], False)
        if req.cancel_at is not None:
            assert row.cancelled and len(row.ids) <= len(alone.ids)
            continue
        if first_divergence_is_a_near_tie(tiny, req.prompt, alone.ids, row.ids) == len(alone.ids):
            assert row.ids == alone.ids and row.finish_reason == alone.finish_reason


def test_a_chunk_says_whether_it_is_its_whole_prompt(tiny) -> None:
    """A prompt prefilled in one chunk is `whole`; one cut by the step's token budget is not, in
    any of its chunks. Only steps whose chunks are whole prompts of up to FUSED_ROWS tokens (a
    prompt the fused op takes alone) leave the step to the fused op on CUDA."""
    from cuda_ext import fixedrate
    prompts = [list(range(3, 3 + n)) for n in (7, 40, 12)]
    s = paged(tiny, max_rows=4, max_tokens=32)
    seen, real = [], s.runner.run
    s.runner.run = lambda decodes, chunks: seen.extend(chunks) or real(decodes, chunks)
    drive(s, tiny, [Req(p, SamplingParams(2)) for p in prompts], lambda _: None)
    cut = [(c.start, len(c.tokens)) for c in seen if not c.whole]
    assert sum(n for _, n in cut) == 40 and len(cut) >= 2 and cut[0][0] == 0              # the 40 in pieces
    assert sorted(len(c.tokens) for c in seen if c.whole) == [7, 12]
    assert all(c.start == 0 for c in seen if c.whole)
    fuses = s.runner._fused_prompts
    short, long_ = fixedrate.FUSED_ROWS, fixedrate.FUSED_ROWS + 1
    assert fuses([]) and fuses([Chunk(list(range(short)), 0, [0], whole=True)] * 2)
    assert not fuses([Chunk(list(range(long_)), 0, [0], whole=True)])
    assert not fuses([Chunk(list(range(10)), 0, [0]), Chunk(list(range(5)), 0, [0], whole=True)])


def test_pipelined_steps_give_the_tokens_of_waiting_steps(tiny) -> None:
    """Decode steps launched before the last one's tokens are pushed (CUDA's pipelining, run
    eagerly here): arrivals, rows waiting for a row, a cancellation; the same tokens, finish
    reasons and logprobs as steps that wait (or parting at a near-tie), every block back."""
    rng = random.Random(4)
    prompts = [p for p in prompts_of(tiny, 12, rng) if len(p) <= 100][:8]
    reqs = [Req(p, SamplingParams(rng.randint(1, 12)), arrive=rng.randint(0, 10)) for p in prompts]
    reqs[2].cancel_at = reqs[2].arrive + 3
    runs = {}
    for pipelined in (False, True):
        s = paged(tiny, max_rows=4, max_tokens=48)
        s.runner.pipelined, ahead = pipelined, []
        rows = drive(s, tiny, reqs, lambda _: ahead.append(s.pending is not None))
        assert s.blocks.used == 0 and s.pending is None and all(q.ahead == 0 for q in s.running)
        runs[pipelined] = rows, sum(ahead)
    assert runs[True][1] > 10 and runs[False][1] == 0                # steps were launched ahead
    for req, waited, piped in zip(reqs, runs[False][0], runs[True][0]):
        if req.cancel_at is not None:
            assert piped.cancelled and piped.ids == waited.ids[:len(piped.ids)]
        elif first_divergence_is_a_near_tie(tiny, req.prompt, waited.ids, piped.ids) == len(waited.ids):
            assert piped.ids == waited.ids and piped.finish_reason == waited.finish_reason
            assert [t.logprob for t in piped.tokens] == pytest.approx([t.logprob for t in waited.tokens], abs=1e-4)


def test_kernels_warmed_beside_serving_are_adopted_between_steps(tiny) -> None:
    """Runner.warm_later (CUDA's Triton kernels; here their references): nothing compiles before
    the first step or the idle deadline; the step it had (here the CPU's ops) serves until the
    warm-up ends, no graph is captured meanwhile, the engine is woken, the next step takes the
    kernels and the row goes on; a warm-up that fails leaves the step it had."""
    refs = step_kernels.REFERENCES
    gate, woken, started = threading.Event(), threading.Event(), threading.Event()
    s = paged(tiny)
    before = s.runner.fused                      # the CPU's step ops (step_kernels.cpu_kernels) or the modules
    s.runner.on_warmed = woken.set
    s.runner.warm_later(refs, lambda: (started.set(), gate.wait()))
    assert 0 < s.runner.warm_due_in() <= 1 and not started.wait(0.1)
    row = Row(tiny.tokenizer.encode("a b c"), SamplingParams(8), tiny)
    s.add(row)
    s.step(), s.step()
    assert started.wait(5) and s.runner.warm_due_in() is None                   # the first step started it
    assert s.runner.fused is before and len(row.ids) == 2 and not s.runner.capture_next()
    gate.set()
    assert woken.wait(5)
    while not s.idle:
        s.step()
    assert s.runner.fused is refs and len(row.ids) == 8 and row.finish_reason == "length"
    broken = paged(tiny)
    broken.runner.warm_later(refs, lambda: 1 / 0, after_s=0)
    broken.runner.capture_next()                                                 # the idle engine's call: due
    assert broken.runner.warmed.wait(5) and not broken.runner.adopt() and broken.runner.fused is before


def test_close_waits_for_the_warm_up_and_frees_what_it_holds(tiny) -> None:
    """An unload during the kernels' warm-up (CUDA: Triton compiling for seconds in a fresh process)
    returns only once the warm-up is over: its toy tensors and the runner it holds are gone then, so
    memory_allocated is back at its baseline (H100 23:19: 2048 bytes left after an unload, ~37 KB
    more a cycle while compiles ran). One not started never starts."""
    held: list[weakref.ref] = []
    started = threading.Event()

    def warm_up() -> None:                      # step_kernels.warm_up: toy tensors, then a long compile
        toy = torch.zeros(64)
        held.append(weakref.ref(toy))
        started.set()
        time.sleep(0.5)

    engine = Engine(tiny, Metrics(), Limits(8, 512, 3, 0.0))
    runner = weakref.ref(engine.batcher.runner)
    engine.batcher.runner.warm_later(step_kernels.REFERENCES, warm_up, after_s=0)   # due: the idle engine starts it
    engine.start()
    assert started.wait(5)
    engine.close()
    assert held[0]() is None and not any(t.name == "wcodec-step-kernels" for t in threading.enumerate())
    del engine
    gc.collect()
    assert runner() is None
    waiting = paged(tiny)
    waiting.runner.warm_later(step_kernels.REFERENCES, started.clear, after_s=0)
    waiting.runner.close()
    assert waiting.runner.warm_due_in() is None and not waiting.runner.capture_next() and started.is_set()


def test_short_prompts_over_the_batch_take_buckets_up_to_the_step_budget(tiny) -> None:
    """A step of short prompts as decode rows may hold up to max_tokens rows (WCODEC_MAX_BATCH_TOKENS),
    past the running batch's max_rows: its graph key takes row buckets up to that budget, and
    the idle engine captures those shapes after every decode step's, so a decode step's graphs
    come first."""
    runner = paged(tiny, max_rows=8, max_tokens=100).runner
    shapes = runner.shapes()
    decode = [k for k in shapes if k[0] <= 8]
    assert shapes == decode + [k for k in shapes if k[0] > 8]
    assert {k[0] for k in shapes} - {k[0] for k in decode} == {16, 32, 64, 100}
    assert not any(fused for _, _, fused in shapes)                  # decoded weights: one graph a shape
    rows = lambda n: [Decode(1, 0, [0])] * n
    assert [runner._shape(rows(n), False)[0] for n in (5, 8, 9, 65, 100)] == [8, 8, 16, 100, 100]
    assert paged(tiny, max_rows=8, max_tokens=4).runner.prompt_rows == 8          # never under max_rows
    assert paged(tiny, max_rows=8, max_tokens=4096).runner.prompt_rows == 512     # the largest bucket
    capped = paged(tiny, max_rows=8, max_tokens=100, prompt_graph_rows=32).runner  # WCODEC_PROMPT_GRAPH_ROWS
    assert capped.prompt_rows == 32 and {k[0] for k in capped.shapes()} - {k[0] for k in decode} == {16, 32}
    assert [capped._shape(rows(n), False)[0] for n in (9, 32)] == [16, 32]
    assert paged(tiny, max_rows=8, max_tokens=100, prompt_graph_rows=0).runner.shapes() == decode   # none
    assert paged(tiny, max_rows=8, max_tokens=100, prompt_graph_rows=1000).runner.prompt_rows == 100


def test_a_prompt_bucket_that_cannot_be_captured_leaves_the_decode_graphs(tiny, monkeypatch, caplog) -> None:
    """The idle engine captures the prompt buckets last; if one fails (out of memory, say), steps
    of prompts over max_rows stay eager and every decode step's graph stays (a decode shape's
    failure still reaches the worker, which stops graphs). Captures faked: this machine has no GPU."""
    runner = paged(tiny, max_rows=8, max_tokens=100).runner
    decode = [k for k in runner.shapes() if k[0] <= 8]

    def capture(rows: int, width: int, fused: bool) -> None:
        if rows > runner.max_rows:
            raise torch.OutOfMemoryError("CUDA out of memory (faked)")
        runner.graphs[(rows, width, fused)] = object()

    monkeypatch.setattr(runner, "_capture", capture)
    runner.use_graphs = True
    assert runner.shape_count == len(runner.shapes()) > len(decode)
    with caplog.at_level("WARNING", logger="wcodec.service"):
        while runner.capture_next():
            pass
    assert sorted(runner.graphs) == sorted(decode) and runner.use_graphs
    assert runner.prompt_rows == 8 and runner.shapes() == decode and runner.shape_count == len(decode)
    assert "prompt step failed" in caplog.text


def test_a_full_cache_preempts_the_latest_arrival_and_makes_requests_wait(tiny) -> None:
    """Rows take blocks as they decode: 5 requests of 3 prompt tokens and 20 new ones (2 blocks
    each by their end) in a 4-block cache start 4 at once, a block each; when a row needs its
    second and none is free, the row that arrived last goes back to the head of the queue and is
    prefilled again (its prompt and tokens, from the prefix cache where they are named) before it
    decodes on. The fifth waits. Every row ends with the tokens it makes alone, the cache is never
    over-full, and no block stays held."""
    s = paged(tiny, max_rows=8, nbytes=1, max_total_tokens=64)        # 64 tokens: 4 blocks
    assert s.blocks.blocks == 4
    prompt = tiny.tokenizer.encode("a b c")
    rows = [Row(prompt, SamplingParams(20), tiny) for _ in range(5)]
    held, steps = [], []
    for row in rows:
        s.add(row)
    while not s.idle:
        steps.append(s.step().preempted)
        held.append(len(s.running) + len(s.prefilling))
        assert s.blocks.used == len({b for q in s.running + s.prefilling for b in q.table}) <= s.blocks.blocks
    assert max(held) == 4 < len(rows) and s.preempted == sum(steps) > 0
    (alone,) = generate(paged(tiny), [Row(prompt, SamplingParams(20), tiny)], False)
    assert all(r.finish_reason == "length" and len(r.ids) == 20 for r in rows) and s.blocks.used == 0
    for r in rows:
        if first_divergence_is_a_near_tie(tiny, prompt, alone, r.ids) == len(alone):
            assert r.ids == alone


@pytest.mark.parametrize("engine", [paged, padded])
def test_a_row_is_marked_admitted_when_a_batch_takes_it(tiny, engine) -> None:
    """Row.admitted_at (the time to first token's split into queue and prefill, worker.py): unset
    while the row waits, set by the step whose batch takes it, later for a row that waited."""
    e = engine(tiny, max_rows=2)
    rows = [Row(tiny.tokenizer.encode("a b c"), SamplingParams(4), tiny) for _ in range(3)]
    for row in rows:
        e.add(row)
    assert [r.admitted_at for r in rows] == [None, None, None]
    before = time.perf_counter()
    e.step()
    assert [r.admitted_at is not None for r in rows] == [True, True, False]     # 2 rows: the third waits
    assert before <= rows[0].admitted_at <= rows[1].admitted_at <= time.perf_counter()
    while not e.idle:
        e.step()
    assert rows[2].admitted_at > rows[1].admitted_at and all(len(r.ids) == 4 for r in rows)


@pytest.mark.parametrize("pipelined", [False, True], ids=["waiting", "pipelined"])
def test_preempted_rows_resume_as_they_were(tiny, pipelined) -> None:
    """In a cache that holds about two of them, 6 rows preempt each other: greedy ones, a seeded
    sampling one, one scoring its prompt; pipelined steps (CUDA's, run eagerly here) too. Each
    resumes where it was: a greedy row's tokens are its tokens alone (or part at a near-tie), the
    sampling row's its seed's, the scored prompt's scores are those alone and come once."""
    rng = random.Random(6)
    prompts = [p for p in prompts_of(tiny, 40, rng) if 20 <= len(p) <= 40][:6]
    assert len(prompts) == 6
    params = [SamplingParams(40, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(40, ignore_eos=True, temperature=0.9, do_sample=True, seed=11)
    params[3] = SamplingParams(40, ignore_eos=True, prompt_logprobs=2)     # the latest of the first 4: preempted
    per = paging.paged.PagedCache.token_bytes(tiny.model.config, paging.cache_dtype(tiny))
    s = paged(tiny, max_rows=6, max_tokens=64, nbytes=per * 160, max_total_tokens=96)   # 10 blocks
    s.runner.pipelined = pipelined
    together, preempt, victims = [Row(p, q, tiny) for p, q in zip(prompts, params)], s._preempt, []
    s._preempt = lambda q: victims.append(together.index(q.row)) or preempt(q)
    generate(s, together, True)
    assert {2, 3} <= set(victims) and s.preempted == len(victims) and s.blocks.used == 0
    for p, q, row in zip(prompts, params, together):
        alone = Row(p, q, tiny)
        generate(paged(tiny), [alone], False)
        assert len(row.ids) == 40 and row.finish_reason == "length"
        if q.prompt_logprobs:                       # scored once, before any preemption
            scores = lambda r: [lp for lp, _ in r.prompt_scores]
            assert scores(row) == pytest.approx(scores(alone), abs=1e-4)
        if q.seed is not None or first_divergence_is_a_near_tie(tiny, p, alone.ids, row.ids) == len(alone.ids):
            assert row.ids == alone.ids


def test_a_request_larger_than_the_cache_is_refused(tiny) -> None:
    s = paged(tiny, nbytes=1, max_total_tokens=32)
    with pytest.raises(ValidationFailed, match="do not fit the KV cache"):
        s.add(Row(tiny.tokenizer.encode("a b c"), SamplingParams(40), tiny))
    assert not s.waiting


def test_the_cache_is_allocated_once(tiny) -> None:
    s = paged(tiny)
    k, v = s.runner.cache.k.data_ptr(), s.runner.cache.v.data_ptr()
    generate(s, [Row(p, SamplingParams(6), tiny) for p in prompts_of(tiny, 4, random.Random(2))], True)
    assert (s.runner.cache.k.data_ptr(), s.runner.cache.v.data_ptr()) == (k, v)
    assert not s.runner.graphs and not s.runner.use_graphs              # no graphs on the CPU


def test_cache_size_follows_the_budget(tiny) -> None:
    per = paging.paged.PagedCache.token_bytes(tiny.model.config, paging.cache_dtype(tiny))
    settings = lambda **k: paging.CacheSettings(block_size=16, max_total_tokens=64, **k)
    assert paging.cache_tokens(tiny, 4, settings(nbytes=per * 100)) == 112        # 100 -> whole blocks
    assert paging.cache_tokens(tiny, 4, settings(nbytes=per * 10 ** 6)) == 4 * 64   # rows x largest request
    assert paging.cache_tokens(tiny, 4, settings(nbytes=0)) == 64                  # one largest request


def test_block_manager() -> None:
    b = BlockManager(5, 4)
    assert b.blocks_for(1) == 1 and b.blocks_for(4) == 1 and b.blocks_for(5) == 2
    t = b.allocate(9)
    assert len(t) == 3 and b.used == 3 and b.usage == 0.6 and not b.can_allocate(9) and b.can_allocate(8)
    with pytest.raises(RuntimeError):
        b.allocate(12)
    b.release(t)
    assert t == [] and b.used == 0 and b.fits(20) and not b.fits(21)


@torch.inference_mode()
def test_paged_forward_equals_llama_forward(tiny) -> None:
    """One prompt in two chunks, then a decode step: the logits equal llama.py's forward's."""
    s = paged(tiny)
    prompt = prompts_of(tiny, 1, random.Random(3))[0]
    table = s.blocks.allocate(len(prompt) + 1)
    from service.engine.inputs import Chunk, Decode
    half = len(prompt) // 2
    a = s.runner.run([], [Chunk(prompt[:half], 0, table)])
    b = s.runner.run([], [Chunk(prompt[half:], half, table)])
    ref = tiny.model(input_ids=torch.tensor([prompt])).logits[0].float()          # [S, V]
    torch.testing.assert_close(a[0], ref[half - 1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(b[0], ref[-1], rtol=2e-2, atol=2e-2)
    token = int(b[0].argmax())
    c = s.runner.run([Decode(token, len(prompt), table)], [])
    ref = tiny.model(input_ids=torch.tensor([prompt + [token]])).logits[0, -1].float()
    torch.testing.assert_close(c[0], ref, rtol=2e-2, atol=2e-2)


async def submit_at_once(engine: Engine, prompt: list[int], n: int, total: int) -> int:
    """`n` requests of `total` tokens at once: each finishes with its length, or is refused with 429
    and Retry-After; every block comes back. Returns how many were refused."""
    reqs, refused = [], 0
    for _ in range(n):
        req = GenRequest(prompt, SamplingParams(total - len(prompt)))
        try:
            engine.submit(req)
            reqs.append(req)
        except QueueFull as e:
            assert e.status_code == 429 and e.headers["Retry-After"] == "1"
            refused += 1
    done = await asyncio.wait_for(asyncio.gather(*(r.result() for r in reqs)), 120)
    assert all(d.finish_reason == "length" for d in done) and len(done) + refused == n
    assert engine.batcher.blocks.used == 0
    return refused


@pytest.mark.anyio
async def test_twice_the_cache_budget_completes_or_gets_429(tiny) -> None:
    """The engine (worker.py) over a cache of 2 requests' worth and a queue of 3, 8 requests at
    once: each finishes or is refused with 429 and Retry-After; nothing is lost or crashes."""
    per = paging.paged.PagedCache.token_bytes(tiny.model.config, paging.cache_dtype(tiny))
    limits = Limits(8, 512, 3, 0.0, cache=paging.CacheSettings(nbytes=per * 2 * 48, max_total_tokens=48))
    metrics = Metrics()
    engine = Engine(tiny, metrics, limits).start()
    try:
        refused = await submit_at_once(engine, tiny.tokenizer.encode("a b c d"), 8, 48)
        assert refused
        text = metrics.render().decode()
        assert 'wcodec_kv_cache_blocks{model="tiny"} 6.0' in text and 'wcodec_kv_cache_usage{model="tiny"} 0.0' in text
    finally:
        engine.close()
    assert "wcodec_kv_cache_usage{" not in metrics.render().decode()


def test_a_failed_step_keeps_its_rows_for_reset(tiny, monkeypatch) -> None:
    """A sampling error on the step that ends the prompts: reset() still answers every row and the
    blocks come back (the worker fails those requests, the server goes on)."""
    from service.engine import scheduler

    s = paged(tiny, max_rows=4, max_tokens=64)
    rows = fail_the_prompts_step(s, scheduler, monkeypatch, tiny)
    assert sorted(map(id, s.reset())) == sorted(map(id, rows)) and s.blocks.used == 0 and not s.waiting


@pytest.mark.parametrize("engine, paged_wanted", [("auto", True), ("paged", True), ("padded", False)])
def test_engine_setting_picks_the_engine(engine, paged_wanted) -> None:
    """WCODEC_ENGINE=auto: the paged engine, on every device; padded: the engine before it."""
    assert paged_engine(engine) is paged_wanted


@pytest.mark.parametrize("kind", ["paged", "padded"])
def test_a_cancelled_row_leaves_the_queue_at_the_next_step_wherever_it_waits(tiny, kind) -> None:
    """One row runs, two wait; the second waiting one is cancelled: the next step answers it and
    takes it out, while the first still waits for the row (it left only at the head before)."""
    left: list[Row] = []
    engine = paged(tiny, max_rows=1, left=left) if kind == "paged" else \
        Batcher(tiny, max_rows=1, max_tokens=512, on_token=lambda r, e: None, on_finish=left.append)
    running, first, second = (Row(p, SamplingParams(40), tiny) for p in prompts_of(tiny, 3, random.Random(4)))
    engine.add(running)
    engine.step()
    engine.add(first)
    engine.add(second)
    second.cancelled = True
    engine.step()
    assert left == [second] and list(engine.waiting) == [first] and not running.done
    while not engine.idle:
        engine.step()
    assert left[1:] == [running, first] if kind == "paged" else first.done


@pytest.mark.anyio
async def test_cancelled_requests_do_not_hold_queue_slots(demo) -> None:
    """A queue of 1 behind one busy row (the demo: seconds for its 400 tokens on a CPU): a waiting
    request that is cancelled frees its slot at once (a new one is queued, not refused with 429),
    and is answered without waiting for the row."""
    engine = Engine(demo, Metrics(), Limits(1, 512, 1, 0.0)).start()
    try:
        prompt = demo.tokenizer.encode("1, 2, 3, 4, 5, 6,")                    # counts on, no EOS
        busy = GenRequest(prompt, SamplingParams(400), stream=True)
        engine.submit(busy)
        await asyncio.wait_for(busy.next(), 30)                  # its first token: the queue is empty
        waiting = GenRequest(prompt, SamplingParams(5))
        engine.submit(waiting)
        waiting.cancel()
        later = GenRequest(prompt, SamplingParams(5))
        engine.submit(later)                                     # QueueFull before
        gone = await asyncio.wait_for(waiting.result(), 30)
        assert gone.finish_reason is None and not busy.outcome_sent
        busy.cancel()
        assert (await asyncio.wait_for(later.result(), 120)).finish_reason == "length"
    finally:
        engine.close()
