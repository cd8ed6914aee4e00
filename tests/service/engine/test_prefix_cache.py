"""The prefix cache (service/engine/blocks.py, scheduler.py): block names, hits, sharing, LRU
eviction; on the tiny model and the demo, a prompt that starts with an earlier prompt or answer
prefills only its tail, and its tokens equal those the same engine makes with the cache off."""
from __future__ import annotations

import pytest
from service_helpers import DEMO
from test_batching import first_divergence_is_a_near_tie, load
from test_scheduler import paged

from service.engine.blocks import BlockManager, names
from service.engine.sampling import Row, SamplingParams

BS = 4


def manager(blocks: int = 8, on: bool = True) -> BlockManager:
    return BlockManager(blocks, BS, on)


def test_a_name_says_its_whole_prefix_and_only_whole_blocks_are_named() -> None:
    a, b = names(list(range(10)), BS, []), names([9] + list(range(1, 10)), BS, [])
    assert len(a) == 2 and len(names(list(range(12)), BS, [])) == 3
    assert a[1] != b[1]                              # the same tokens 4..7 after another first block
    assert names(list(range(10)), BS, a[:1]) == a == names(list(range(8)), BS, [])
    assert names([], BS, []) == [] and len(set(a + b)) == 4


def test_hits_are_the_longest_named_run_before_the_prompts_last_token() -> None:
    m, prompt = manager(), list(range(12))
    table = m.allocate(12)
    m.name(table, names(prompt, BS, []))
    assert m.hits(names(prompt, BS, []), 12) == table[:2]           # the last token's block is computed
    assert m.hits(names(prompt + [1], BS, []), 13) == table[:3]
    other = prompt[:4] + [99] + prompt[5:]
    assert m.hits(names(other, BS, []), 12) == table[:1]            # stops at the first unknown block
    assert manager(on=False).hits(names(prompt, BS, []), 12) == []


def test_shared_blocks_are_held_until_their_last_holder_leaves() -> None:
    m, prompt = manager(), list(range(9))
    first = m.allocate(12)
    m.name(first, names(prompt, BS, []))
    hits = m.hits(names(prompt, BS, []), 9)
    second = m.allocate(12, hits)
    assert second[:2] == first[:2] and m.refs[first[0]] == 2 and m.used == 4
    m.release(first)
    assert m.used == 3 and m.refs[second[0]] == 1
    m.release(second)
    assert m.used == 0 and m.cached == 2


def test_can_allocate_counts_the_free_blocks_its_hits_take() -> None:
    m, prompt = manager(4), list(range(9))
    table = m.allocate(9)                           # 3 blocks
    m.name(table, names(prompt, BS, []))
    m.release(table)                                # 2 named blocks idle, 2 unnamed free
    hits = m.hits(names(prompt, BS, []), 9)
    assert len(hits) == 2 and m.can_allocate(16, hits) and not m.can_allocate(17, hits)
    assert len(m.allocate(16, hits)) == 4 and not m.free


def test_eviction_takes_unnamed_blocks_then_the_least_recently_released_tails() -> None:
    m = manager(6)
    p, q = list(range(100, 109)), list(range(200, 209))
    tp, tq = m.allocate(9), m.allocate(9)
    m.name(tp, names(p, BS, []))
    m.name(tq, names(q, BS, []))
    m.release(list(tp))
    m.release(list(tq))                             # free, head first: tq[2], tp[2], tp[1], tp[0], tq[1], tq[0]
    assert m.allocate(4) == [tq[2]] and m.allocate(4) == [tp[2]]
    assert m.allocate(4) == [tp[1]]                 # p's second block evicted: p hits its first only
    assert m.hits(names(p, BS, []), 9) == [tp[0]] and m.hits(names(q, BS, []), 9) == tq[:2]


def test_a_block_is_named_once_and_a_name_held_once() -> None:
    m, prompt = manager(), list(range(8))
    a, b = m.allocate(8), m.allocate(8)
    m.name(a, names(prompt, BS, []))
    m.name(b, names(prompt, BS, []))                # the same tokens computed twice: a keeps the name
    assert m.hits(names(prompt + [0], BS, []), 9) == a
    m.release(list(b))
    assert list(m.free)[:2] == b                    # unnamed: at the head, evicted first


@pytest.fixture(scope="module")
def tiny(tiny_archive):
    return load(tiny_archive, "tiny")


@pytest.fixture(scope="module")
def demo(demo_archive):
    return load(demo_archive, DEMO)


def run(engine, rows: list[Row]) -> list[Row]:
    for row in rows:
        engine.add(row)
        while not engine.idle:
            engine.step()
    return rows


def test_a_prompt_after_an_earlier_one_prefills_only_its_tail(tiny) -> None:
    """The second prompt repeats the first's 40 tokens: 32 of them (two blocks of 16) come from the
    cache, and the step feeds only the rest, as one whole chunk (runner.py: the chunk it is alone);
    with the cache off, every token is fed."""
    first, second = list(range(3, 43)), list(range(3, 43)) + [7, 8, 9]
    fed = {}
    for on in (True, False):
        s = paged(tiny, max_rows=4, max_tokens=512, prefix_caching=on)
        real = s.runner.run
        chunks = []
        s.runner.run = lambda decodes, cs: chunks.extend(cs) or real(decodes, cs)
        rows = run(s, [Row(first, SamplingParams(6), tiny), Row(second, SamplingParams(6), tiny)])
        fed[on] = [(c.start, len(c.tokens)) for c in chunks], [r.cached_tokens for r in rows], [r.ids for r in rows]
        assert all(c.whole for c in chunks)         # the tail past the hits is what it is alone
        assert s.blocks.used == 0
    assert fed[True][0] == [(0, 40), (32, 11)] and fed[True][1] == [0, 32]
    assert fed[False][0] == [(0, 40), (0, 43)] and fed[False][1] == [0, 0]
    for prompt, cached, fresh in zip((first, second), fed[True][2], fed[False][2]):
        if first_divergence_is_a_near_tie(tiny, prompt, fresh, cached) == len(fresh):
            assert cached == fresh


def test_an_answer_is_cached_for_the_next_turn(tiny) -> None:
    """Blocks of generated tokens are named when the row leaves: a prompt that is the first's prompt
    and answer (a chat's next turn) finds blocks past the first prompt's."""
    s = paged(tiny, max_rows=4, max_tokens=512)
    (first,) = run(s, [Row(list(range(3, 23)), SamplingParams(30, ignore_eos=True), tiny)])
    turn = first.prompt_ids + first.ids + [5, 6]
    (second,) = run(s, [Row(turn, SamplingParams(2), tiny)])
    written = len(first.prompt_ids) + len(first.ids) - 1      # the newest token was never fed
    assert second.cached_tokens == written // 16 * 16 > 16


def test_a_row_scoring_its_prompt_reads_no_cache(tiny) -> None:
    s = paged(tiny, max_rows=4, max_tokens=512)
    prompt = list(range(3, 40))
    run(s, [Row(prompt, SamplingParams(2), tiny)])
    (scored,) = run(s, [Row(prompt, SamplingParams(2, prompt_logprobs=1), tiny)])
    (plain,) = run(s, [Row(prompt, SamplingParams(2), tiny)])
    assert scored.cached_tokens == 0 and len(scored.prompt_scores) == len(prompt) - 1
    assert plain.cached_tokens == 32


def test_the_demos_chat_turns_share_their_system_prompt(demo) -> None:
    """The demo's chat template starts every conversation with the same system prompt: a second
    question reads its blocks from the cache and still answers as with the cache off."""
    tok = demo.tokenizer
    chat = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True)
    prompts = [chat("Write a haiku about the sea."), chat("What is the capital of France?")]
    out = {}
    for on in (True, False):
        s = paged(demo, max_rows=4, max_tokens=512, prefix_caching=on)
        out[on] = run(s, [Row(p, SamplingParams(12), demo) for p in prompts])
    assert out[True][0].cached_tokens == 0 and out[True][1].cached_tokens >= 16
    assert [r.ids for r in out[True]] == [r.ids for r in out[False]]
    assert tok.decode(out[True][1].ids, skip_special_tokens=True) == "The capital of France is Paris."


def test_a_tail_past_its_hits_goes_in_as_decode_rows() -> None:
    """On CUDA a chunk's tokens go in as decode rows (a prompt graph's replay) when they read no
    more keys than a 256-token prompt does: so does a long prompt's short tail past its hits, not a
    prompt of 257 tokens."""
    from types import SimpleNamespace

    from service.engine.runner import Chunk, Runner
    as_rows = lambda *chunks: Runner._prompts_as_rows(SimpleNamespace(fused=object()), list(chunks))
    assert as_rows(Chunk(list(range(256)), 0, [])) and not as_rows(Chunk(list(range(257)), 0, []))
    assert as_rows(Chunk(list(range(20)), 656, []), Chunk(list(range(40)), 0, []))
    assert not as_rows(Chunk(list(range(20)), 656, []), Chunk(list(range(120)), 600, []))
