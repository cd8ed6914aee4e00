"""The paged engine on CUDA (scripts/gpu/run.sh, stage engine): greedy tokens of captured decode
steps equal the padded eager engine's on the demo model (5 prompts x 32 alone, 8 together; needs
the demo package), and so do compressed mode's, its decodes captured in the graphs, against its
eager steps, and so do the fixed-rate form's with its embedding table read from the host; on the
tiny random Llama (runs anywhere): a graph replay equals the eager paged step; closing frees graphs and cache; twice the cache's budget in concurrent requests through the
engine: each completes or gets a 429, none is lost."""
from __future__ import annotations

import gc

import pytest
import torch
from service_helpers import DEMO
from test_batching import load
from test_prompt_logprobs import TOP, check
from test_scheduler import PROMPTS, generate, submit_at_once

from service.engine import Batcher, Engine, Limits, paging
from service.engine.inputs import Chunk, Decode
from service.engine.sampling import Row, SamplingParams
from service.load import pipeline
from service.metrics import Metrics
from service.model import build, fixed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def demo(demo_archive) -> build.ServedModel:
    return load(demo_archive, DEMO, CUDA)


@pytest.fixture(scope="module")
def tiny(tiny_archive) -> build.ServedModel:
    """The random tiny Llama (needs no demo package: runs on any GPU box)."""
    return load(tiny_archive, "tiny", CUDA)


def paged(served, **cache):
    """The paged scheduler with its Triton kernels adopted (warmed beside serving: runner.py)."""
    s = paging.scheduler(served, 64, 512, paging.CacheSettings(**cache), lambda r, e: None, lambda r: None)
    s.runner.start_warming(now=True)
    assert s.runner.warmed.wait(300)
    s.runner.adopt()
    return s


def partings(demo, prompts: list[str], ours: list[list[int]], theirs: list[list[int]]) -> list[tuple[str, int, float]]:
    """Where the two engines' tokens first part, per prompt that parts: (prompt, token, the eager
    model's top-2 logit margin there, in bf16 places of the top logit)."""
    out = []
    for p, a, b in zip(prompts, ours, theirs):
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:
            ids = torch.tensor([demo.tokenizer.encode(p) + b[:j]], device=CUDA)
            top = demo.model(input_ids=ids).logits[0, -1].float().topk(2).values
            place = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)              # bf16's spacing at the top logit
            out.append((p, j, float((top[0] - top[1]) / place)))
    return out


@pytest.mark.parametrize("kind", ["triton", "modules"])
@pytest.mark.parametrize("together", [False, True], ids=["batch1", "batch8"])
def test_graph_tokens_equal_the_padded_eager_engine(demo, together, kind, monkeypatch) -> None:
    """Both step kinds (Triton's kernels; WCODEC_TRITON=0: the modules), decode steps replayed
    (and pipelined): the padded engine's tokens, or parting at a tie of the bf16 logits (their
    top two within two bf16 places: seen on the H100 for one of the prompts, a margin of 0.125,
    either way round, as rounding in either engine tips it), for one prompt at most."""
    monkeypatch.setenv("WCODEC_TRITON", "1" if kind == "triton" else "0")
    prompts = PROMPTS if together else PROMPTS[:5]
    rows = lambda: [Row(demo.tokenizer.encode(p), SamplingParams(32), demo) for p in prompts]
    s = paged(demo)
    assert (s.runner.fused is not None) == (kind == "triton")
    ours = generate(s, rows(), together)
    assert s.runner.use_graphs and s.runner.graphs                        # the decode steps were replayed
    eager = Batcher(demo, max_rows=64, max_tokens=512, on_token=lambda r, e: None, on_finish=lambda r: None)
    theirs = generate(eager, rows(), together)
    with torch.inference_mode():
        parted = partings(demo, prompts, ours, theirs)
    print(f"{kind} {'batch8' if together else 'batch1'} ({demo.dtype}): equal {len(prompts) - len(parted)} of "
          f"{len(prompts)}; partings (prompt, token, top-2 margin in bf16 places): {parted}")
    assert all(margin <= 2 for _, _, margin in parted)             # only at a tie of the bf16 logits
    assert len(parted) <= 1


@pytest.fixture(scope="module")
def packed(dense_demo_archive) -> build.ServedModel:
    """The demo float-coded (its GGUF blocks dequantized), its layers kept compressed."""
    decoded = pipeline.decode_archive(dense_demo_archive, CUDA, compressed=True)
    return build.finish(DEMO, build.prepare(DEMO, decoded.files), decoded.tensors, decoded.layers, CUDA)


@pytest.mark.parametrize("together", [False, True], ids=["batch1", "batch8"])
def test_compressed_mode_captures_its_decodes(packed, together) -> None:
    """weights=compressed: the decode steps are graphs too, each Linear decoded on the side stream
    inside them (compressed.py). Their tokens equal compressed mode's eager steps' (the same
    kernels, the same unjoined matmuls), every prompt, every token; its statuses stay clean."""
    assert packed.schedule is not None and packed.schedule.linears_only
    prompts = PROMPTS if together else PROMPTS[:5]
    rows = lambda: [Row(packed.tokenizer.encode(p), SamplingParams(32), packed) for p in prompts]
    s = paged(packed)
    assert s.runner.use_graphs and s.runner.fused is not None
    ours = generate(s, rows(), together)
    assert s.runner.graphs                                                # the decode steps were replayed
    eager = paged(packed, cuda_graphs=False)
    assert not eager.runner.use_graphs
    theirs = generate(eager, rows(), together)
    assert ours == theirs
    torch.cuda.synchronize()
    packed.schedule._forward_starts()                                     # reads and checks every status


def test_an_untied_embedding_is_read_from_the_host_inside_the_graphs(untied_tiny_archive) -> None:
    """The fixed-rate form with a head of its own: the embedding table stays in page-locked host
    memory (fixed.HostEmbedding), outside the device bytes; the replayed decode steps read it and
    give the eager steps' tokens, every prompt, every token; decoded mode's table, bit for bit."""
    d = pipeline.decode_archive(untied_tiny_archive, CUDA, compressed=True, form="fixed")
    packed = build.finish("tiny", build.prepare("tiny", d.files), d.tensors, d.layers, CUDA, fixed_form=d.fixed)
    emb, decoded = packed.model.model.embed_tokens, load(untied_tiny_archive, "tiny", CUDA)
    assert isinstance(emb, fixed.HostEmbedding) and emb.weight.is_pinned() and packed.host_bytes == emb.weight.nbytes
    assert torch.equal(emb.weight.view(torch.int16), decoded.model.model.embed_tokens.weight.cpu().view(torch.int16))
    linears = [m for m in packed.model.modules() if isinstance(m, fixed.FixedLinear)]
    on_device = sum(m.weight_form.nbytes for m in linears) + sum(p.nbytes for p in packed.model.parameters())
    assert isinstance(packed.model.lm_head, fixed.FixedLinear) and packed.weight_bytes == on_device
    rows = lambda: [Row(packed.tokenizer.encode(p), SamplingParams(16), packed) for p in PROMPTS]
    s = paged(packed)
    ours = generate(s, rows(), True)
    assert s.runner.use_graphs and s.runner.graphs
    assert ours == generate(paged(packed, cuda_graphs=False), rows(), True)


def from_one_cache(runner, first, second) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of two runs of one step (each writes its keys), the KV cache put back between them."""
    snapshot = runner.cache.k.clone(), runner.cache.v.clone()
    a = first().clone()
    runner.cache.k.copy_(snapshot[0])
    runner.cache.v.copy_(snapshot[1])
    return a, second()


def same_step(replayed: torch.Tensor, eager: torch.Tensor, places: int = 0, atol: float = 0.0) -> None:
    """The same logits within `places` bf16 places of the largest (or `atol`), and the same picks."""
    tol = places * torch.finfo(torch.bfloat16).eps * float(eager.abs().max()) if places else atol
    torch.testing.assert_close(replayed, eager, rtol=0, atol=tol)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


def a_burst(s) -> tuple[list[Decode], list[Chunk]]:
    """3 decode rows (their keys written) and 6 prompts of 20 tokens: 123 rows as decode rows."""
    tables = [s.blocks.allocate(64) for _ in range(9)]
    for i, t in enumerate(tables[:3]):
        s.runner.run([], [Chunk(list(range(10 + i, 30 + i)), 0, t)])
    return ([Decode(11 + i, 20, t) for i, t in enumerate(tables[:3])],
            [Chunk(list(range(40 + i, 60 + i)), 0, t) for i, t in enumerate(tables[3:])])


def count_replays(runner) -> list[int]:
    """The rows of each graph replay of `runner` from now on."""
    replays, replay = [], runner._replay
    runner._replay = lambda rows, fuse: replays.append(len(rows)) or replay(rows, fuse)
    return replays


def eagerly(runner, decodes: list[Decode]):
    """A step of `decodes` with graphs off (from_one_cache's second run)."""
    def run():
        runner.use_graphs = False
        return runner.run(decodes, [])
    return run


@torch.inference_mode()
def test_decode_rows_alone_take_the_fused_op_up_to_64_rows(untied_tiny_archive, monkeypatch) -> None:
    """The fixed-rate form: a step of 40 decode rows replays a 64-row graph captured with the fused
    op on every Linear (no weight decoded into the scratch) and gives the eager step's logits in
    fixed.decode_only's block (within four bf16 places; its picks theirs); 40 rows with a part of a
    prompt among them decode each weight and call cuBLAS, eagerly and in their own 64-row graph,
    as a long prompt's prefill does; with a whole 10-token prompt instead they take the fused graph,
    and eagerly the fused op too, with the same logits. Decoded mode has one graph a shape."""
    from cuda_ext import fixedrate
    d = pipeline.decode_archive(untied_tiny_archive, CUDA, compressed=True, form="fixed")
    packed = build.finish("tiny", build.prepare("tiny", d.files), d.tensors, d.layers, CUDA, fixed_form=d.fixed)
    s = paged(packed, max_total_tokens=64)
    runner, linears = s.runner, sum(isinstance(m, fixed.FixedLinear) for m in packed.model.modules())
    assert runner.wide == range(33, 65) and linears > 0
    assert {k for k in runner.shapes() if k[2]} == {(64, w, True) for _, w, _ in runner.shapes()}
    scratch = []                                                          # rows of each decode + cuBLAS call
    real = fixedrate._decode_matmul
    monkeypatch.setattr(fixedrate, "_decode_matmul", lambda flat, fr: scratch.append(flat.shape[0]) or real(flat, fr))
    tables = [s.blocks.allocate(8) for _ in range(41)]
    decodes = [Decode(11 + i, 2 + i % 5, t) for i, t in enumerate(tables[:40])]
    def eager_fused():
        assert [k for k in runner.graphs if k[0] == 64] == [(64, 1, True)] and scratch == []
        runner.use_graphs = False
        with fixed.decode_only(64):
            return runner.run(decodes, [])

    replayed, eager = from_one_cache(runner, lambda: runner.run(decodes, []), eager_fused)
    assert scratch == []
    same_step(replayed, eager, places=4)
    runner.use_graphs = True
    prompt = Chunk(list(range(5, 15)), 0, tables[40])                     # 30 decode rows + 10 prompt rows
    runner.run(decodes[:30], [prompt])                                    # no graph of its key yet: eager
    assert scratch and set(scratch) == {40}
    scratch.clear()
    runner._capture(64, 1, False)                                         # its graph: decode + cuBLAS too
    assert (64, 1, False) in runner.graphs and scratch and set(scratch) == {64}
    scratch.clear()
    whole = Chunk(list(range(5, 15)), 0, tables[40], whole=True)          # the prompt's every token
    def eager_with_prompt():                                              # no graph of its key: eager, fused
        del runner.graphs[(64, 1, True)]
        return runner.run(decodes[:30], [whole])

    replayed, eager = from_one_cache(runner, lambda: runner.run(decodes[:30], [whole]), eager_with_prompt)
    assert scratch == [] and replayed.shape == eager.shape == (31, replayed.shape[1])
    same_step(replayed, eager, places=4)
    decoded = paged(load(untied_tiny_archive, "tiny", CUDA), max_total_tokens=64).runner
    assert decoded.wide == range(0) and all(not k[2] for k in decoded.shapes())


@torch.inference_mode()
def test_a_replay_equals_the_eager_step(tiny) -> None:
    s = paged(tiny)
    tables = [s.blocks.allocate(64) for _ in range(3)]
    for i, t in enumerate(tables):                                        # some keys in the cache
        s.runner.run([], [Chunk(list(range(10 + i, 30 + 4 * i)), 0, t)])
    decodes = [Decode(11, 20 + 3 * i, t) for i, t in enumerate(tables)]
    replayed, eager = from_one_cache(s.runner, lambda: s.runner.run(decodes, []), eagerly(s.runner, decodes))
    print("largest |replay - eager| logit:", float((replayed - eager).abs().max()))
    same_step(replayed, eager, atol=2e-2)


@torch.inference_mode()
def test_a_burst_of_short_prompts_over_64_rows_replays_its_graph(tiny) -> None:
    """6 prompts of 20 tokens beside 3 decode rows (123 rows, over the 64 of the running batch)
    go in as decode rows of one step: once its 128-row graph is captured (one of the shapes the
    idle engine captures, the prompt buckets last), the step replays it and gives the eager step's
    logits and picks. Its graph and a decode step's write their logits into one buffer."""
    s = paged(tiny)
    runner = s.runner
    assert runner.prompt_rows == 512 and {128, 256, 512} <= {rows for rows, _, _ in runner.shapes()}
    decodes, prompts = a_burst(s)
    key = runner._shape(decodes + runner._prompt_rows(prompts), False)
    assert key[0] == 128 and key in runner.shapes() and key not in runner.graphs
    replays = count_replays(runner)
    eager = runner.run(decodes, prompts).clone()                          # no graph of its key yet: eager
    assert replays == []
    runner._capture(*key)
    replayed = runner.run(decodes, prompts)                               # each writes the same keys
    assert replays == [123] and replayed.shape == eager.shape == (3 + 6, eager.shape[1])
    same_step(replayed, eager, atol=2e-2)
    small = runner._capture(*runner._shape(decodes, False))
    assert small.logits.data_ptr() == runner.graphs[key].logits.data_ptr() == runner.logits.data_ptr()   # one buffer
    assert runner.logits.shape == (512, eager.shape[1])


@torch.inference_mode()
def test_a_prompt_bucket_failing_inside_its_capture_leaves_the_decode_graphs(tiny, monkeypatch, caplog) -> None:
    """A prompt bucket's capture that fails inside torch.cuda.graph (out of memory raised once the
    step's kernels are captured, where a real one would strike) ends that capture and frees what it
    held; every decode step's graph stays and replays the eager step's logits, and a step of 6
    prompts beside 3 decode rows (123 rows) runs eagerly with the same logits as before."""
    gc.collect()                                                          # earlier tests' garbage freed now, not below
    s = paged(tiny, max_total_tokens=64)
    runner = s.runner
    decodes, prompts = a_burst(s)
    burst = lambda: runner.run(decodes, prompts)
    before, _ = from_one_cache(runner, burst, lambda: None)              # eager: no graph of its key yet
    decode_keys = [k for k in runner.shapes() if k[0] <= runner.max_rows]
    step, held = runner._step_of_graph, []

    def failing(g, fused):
        out = step(g, fused)
        if g.rows > runner.max_rows and torch.cuda.is_current_stream_capturing():
            held.append(torch.cuda.memory_allocated())
            raise torch.OutOfMemoryError("CUDA out of memory (injected inside the capture)")
        return out

    monkeypatch.setattr(runner, "_step_of_graph", failing)
    allocated = []
    with caplog.at_level("WARNING", logger="wcodec.service"):
        while runner.capture_next():
            allocated.append(torch.cuda.memory_allocated())
    assert "prompt step failed (OutOfMemoryError: CUDA out of memory (injected" in caplog.text and len(held) == 1
    gc.collect()
    torch.cuda.synchronize()
    assert sorted(runner.graphs) == sorted(decode_keys) and runner.use_graphs and runner.prompt_rows == runner.max_rows
    assert torch.cuda.memory_allocated() <= allocated[-2] < held[0]     # the failed capture's tensors are freed
    replays = count_replays(runner)
    after, _ = from_one_cache(runner, burst, lambda: None)
    assert replays == [] and torch.equal(after, before)                   # eager, as before the failure
    replayed, eager = from_one_cache(runner, lambda: runner.run(decodes, []), eagerly(runner, decodes))
    assert replays == [3]
    same_step(replayed, eager, atol=2e-2)


def test_closing_frees_graphs_and_cache(tiny) -> None:
    """After a first engine (the process's first capture allocates the capture stream's cuBLAS
    workspace, kept as every stream's is), a second one's graphs and cache are all given back."""
    def run_and_close(graphs: int) -> None:
        s = paged(tiny, nbytes=1 << 30)
        generate(s, [Row(tiny.tokenizer.encode(p), SamplingParams(8), tiny) for p in PROMPTS], True)
        while len(s.runner.graphs) < graphs and s.runner.capture_next():
            pass
        assert len(s.runner.graphs) >= graphs and torch.cuda.memory_allocated() > base + s.runner.cache.nbytes // 2
        s.runner.close()

    base = 0
    run_and_close(2)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    run_and_close(12)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


@pytest.mark.anyio
async def test_twice_the_cache_budget_completes_or_gets_429(tiny) -> None:
    """A cache of 4 requests' worth, a queue of 3, 8 requests at once: each finishes or is refused
    with 429 and Retry-After; nothing is lost, nothing crashes, the blocks all come back."""
    per = paging.paged.PagedCache.token_bytes(tiny.model.config, paging.cache_dtype(tiny))
    limits = Limits(64, 512, 3, 0.0, engine="paged", cache=paging.CacheSettings(nbytes=per * 4 * 64, max_total_tokens=64))
    engine = Engine(tiny, Metrics(), limits).start()
    try:
        assert await submit_at_once(engine, tiny.tokenizer.encode(PROMPTS[0]), 8, 64)
    finally:
        engine.close()


def test_prompt_logprobs_on_cuda(tiny) -> None:
    """A scoring row's prompt goes in as decode rows of the Triton step (runner._last_rows picks
    every one of its rows' logits): eagerly, then replaying the captured graph of that shape; the
    scores equal the whole forward's, and the row beside it keeps its tokens alone."""
    tok = tiny.tokenizer
    prompts = [tok(f"<|im_start|>user\n{t}<|im_end|>\n")["input_ids"] for t in ("the river city", "a stone light")]
    s = paged(tiny)
    replays = []
    replay = s.runner._replay
    s.runner._replay = lambda rows, alone: replays.append(len(rows)) or replay(rows, alone)
    alone = generate(paged(tiny), [Row(prompts[1], SamplingParams(4), tiny)], False)[0]
    for graphs in (False, True):
        while graphs and s.runner.capture_next():
            pass
        replays.clear()
        scoring = Row(prompts[0], SamplingParams(4, prompt_logprobs=TOP), tiny)
        plain = Row(prompts[1], SamplingParams(4), tiny)
        assert generate(s, [scoring, plain], together=True)[1] == alone
        check(scoring)
        fed = sum(map(len, prompts)) - plain.cached_tokens                    # its first block cached the 2nd time
        assert (max(replays, default=0) >= fed) == graphs                     # the prompts' step replayed or not


@torch.inference_mode()
def test_a_prompt_past_its_prefix_cache_hits(tiny) -> None:
    """A prompt that repeats an earlier one's 40 tokens takes its two whole leading blocks from the
    prefix cache (blocks.py) and generates; its tail's next-token logits, its tokens going in as
    decode rows against those blocks, equal a fresh prefill's of the whole prompt. (A tail that
    reads more keys than a 256-token prompt goes through SDPA's prefill, as long prompts do: the
    tiny Llama's 256 positions cannot make one.)"""
    from service.engine.blocks import names
    first, second = list(range(3, 43)), list(range(3, 43)) + [7, 8, 9]
    s = paged(tiny)
    rows = [Row(p, SamplingParams(4, ignore_eos=True), tiny) for p in (first, second)]
    generate(s, rows, False)
    hit = (len(second) - 1) // 16 * 16
    assert [r.cached_tokens for r in rows] == [0, hit] and [len(r.ids) for r in rows] == [4, 4]
    assert s.blocks.used == 0
    hits = s.blocks.hits(names(second, 16, []), len(second))
    tail = s.runner.run([], [Chunk(second[hit:], hit, s.blocks.allocate(len(second), hits), whole=True)]).clone()
    fresh = s.runner.run([], [Chunk(second, 0, s.blocks.allocate(len(second)), whole=True)])
    same_step(tail, fresh, atol=2e-2)


@torch.inference_mode()
def test_rows_preempted_under_graphs_resume(tiny) -> None:
    """Graphs and pipelined steps: 6 greedy rows of 30 prompt tokens and 40 new ones in a 10-block
    cache preempt each other (scheduler.py) and resume. Each ends with its 40 tokens, equal to its
    tokens in a roomy cache up to where the roomy run's two best logits are within 2 bf16 places
    of each other (compared no further there); every block comes back."""
    prompts = [list(range(5 + i, 35 + i)) for i in range(6)]
    per = paging.paged.PagedCache.token_bytes(tiny.model.config, paging.cache_dtype(tiny))

    def run(**cache):
        s = paged(tiny, **cache)
        rows = [Row(p, SamplingParams(40, ignore_eos=True), tiny) for p in prompts]
        generate(s, rows, True)
        assert s.blocks.used == 0 and all(len(r.ids) == 40 for r in rows)
        return s, [r.ids for r in rows]
    small, ours = run(nbytes=per * 160, max_total_tokens=96)
    roomy, theirs = run()
    assert small.blocks.blocks == 10 and small.preempted > 0 and roomy.preempted == 0
    for p, a, b in zip(prompts, ours, theirs):
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:
            top = tiny.model(input_ids=torch.tensor([p + b[:j]], device=CUDA)).logits[0, -1].float().topk(2).values
            place = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)
            assert float((top[0] - top[1]) / place) <= 2, (p, j)
