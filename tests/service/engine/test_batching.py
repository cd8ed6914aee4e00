"""Continuous batching never mixes rows: every request's tokens under batching, with mixed prompt
lengths, arrivals at different steps, chunked prefill, rows waiting for a free row, a cancellation
and rows finishing at different steps, equal its tokens alone (prefilled in one piece). Where a
token differs, the test shows that the alone run's top two logits there were within 1e-3 of each
other (floating-point reordering in a batched matmul may flip a near-tie, nothing more), and
compares no further. The real demo model, computing as the server does on this CPU (cpu_dtype.py,
`auto`: on a CPU without native bf16, bf16 matmuls for a row or two and float32 ones for a
batch, so batched and alone rows may take different paths), and the random tiny Llama. Also: the token budget per step, rows and KV leave at once, seeds."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from service_helpers import DEMO

from service.load import pipeline
from service.model import build
from service.engine import Batcher, batcher
from service.model import cpu_dtype
from service.engine.sampling import Row, SamplingParams

TIE = 1e-3
CPU = torch.device("cpu")


def load(path, name: str, device: torch.device = CPU) -> build.ServedModel:
    """The model as the server builds it (on the CPU in its compute dtype)."""
    decoded = pipeline.decode_archive(path, device)
    served = build.finish(name, build.prepare(name, decoded.files), decoded.tensors, decoded.layers, device)
    return cpu_dtype.for_cpu(served, "auto") if device.type == "cpu" else served


@pytest.fixture(scope="module")
def demo(demo_archive) -> build.ServedModel:
    return load(demo_archive, DEMO)


@pytest.fixture(scope="module")
def tiny(tiny_archive) -> build.ServedModel:
    return load(tiny_archive, "tiny")


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    arrive: int = 0                  # the step before which it is added
    cancel_at: int | None = None     # the step before which it is cancelled


def drive(engine, served, reqs: list[Req], check) -> list[Row]:
    """Step `engine` (a Batcher or a Scheduler) until idle, adding each request at its arrival step
    and cancelling at its cancel step; `check(step result)` after every step. Returns the rows."""
    rows = [Row(r.prompt, r.params, served) for r in reqs]
    step = 0
    while step <= max(r.arrive for r in reqs) or not engine.idle:
        for row, r in zip(rows, reqs):
            if r.arrive == step:
                engine.add(row)
            if r.cancel_at == step:
                row.cancelled = True
        check(engine.step())
        step += 1
    return rows


def run(served, reqs: list[Req], *, max_rows: int, max_tokens: int):
    """Drive a Batcher step by step; returns the rows, the steps, and the order rows left in."""
    left, steps = [], []
    b = Batcher(served, max_rows=max_rows, max_tokens=max_tokens, on_token=lambda row, e: None,
                on_finish=left.append)
    def check(step):
        steps.append(step)
        assert b.kv.rows == len(b.running) and all(not r.done for r in b.running)

    rows = drive(b, served, reqs, check)
    assert b.kv.rows == 0 and b.kv.width == 0 and b.group is None
    return rows, steps, left


@torch.inference_mode()
def first_divergence_is_a_near_tie(served, prompt: list[int], alone: list[int], batched: list[int]) -> int:
    """The index of the first differing token (len when none); asserts it was a near-tie."""
    t = next((i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), min(len(alone), len(batched)))
    if t < min(len(alone), len(batched)):
        logits = served.model(input_ids=torch.tensor([prompt + alone[:t]]), logits_to_keep=1).logits[0, -1].float()
        top = torch.topk(logits, 2)
        assert batched[t] in top.indices.tolist(), (t, alone[t], batched[t])
        assert float(top.values[0] - top.values[1]) < TIE, (t, top.values.tolist())
    return t


def prompts_of(served, n: int, rng: random.Random) -> list[list[int]]:
    tok = served.tokenizer
    words = "the a river city light stone music winter garden question answer machine story".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 10, 25, 50])))
        out.append(tok(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    return out


def check_against_alone(served, reqs: list[Req], **limits) -> list:
    """Batched vs alone, request by request; returns the batched run's steps."""
    rows, steps, left = run(served, reqs, **limits)
    for req, row in zip(reqs, rows):
        (alone,), _, _ = run(served, [Req(req.prompt, req.params)], max_rows=1, max_tokens=4096)
        if req.cancel_at is not None:
            assert row.cancelled and row.finish_reason is None and len(row.ids) < len(alone.ids)
            first_divergence_is_a_near_tie(served, req.prompt, alone.ids[:len(row.ids)], row.ids)
        elif req.params.sampling or req.params.repetition_penalty:    # not the plain logits' argmax
            assert row.ids == alone.ids and row.finish_reason == alone.finish_reason
        elif first_divergence_is_a_near_tie(served, req.prompt, alone.ids, row.ids) == len(alone.ids):
            assert row.ids == alone.ids and row.finish_reason == alone.finish_reason and row.text == alone.text
    assert sorted(map(id, left)) == sorted(map(id, rows))                    # each row left once
    assert all(s.tokens <= limits["max_tokens"] for s in steps)
    return steps


def test_demo_batched_equals_alone(demo) -> None:
    prompts = prompts_of(demo, 7, random.Random(0))
    lengths = (8, 4, 10, 6, 9, 3, 7)
    reqs = [Req(p, SamplingParams(n), arrive=a) for p, n, a in zip(prompts, lengths, [0, 0, 0, 1, 2, 4, 6])]
    reqs[2].cancel_at = 4
    reqs[4].params = SamplingParams(9, temperature=0.8, top_k=40, seed=7)
    reqs[5].params = SamplingParams(6, stop=("\n",), repetition_penalty=1.3)
    assert max(len(p) for p in prompts) > 40 > min(len(p) for p in prompts)  # some are prefilled in chunks
    steps = check_against_alone(demo, reqs, max_rows=3, max_tokens=40)
    assert max(s.rows for s in steps) == 3                                  # rows waited for a free row


def test_tiny_many_arrivals_equal_alone(tiny) -> None:
    rng = random.Random(1)
    prompts = prompts_of(tiny, 12, rng)
    reqs = [Req(p, SamplingParams(rng.randint(1, 12)), arrive=rng.randint(0, 15)) for p in prompts]
    check_against_alone(tiny, reqs, max_rows=8, max_tokens=48)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(demo) -> None:
    tok = demo.tokenizer
    short = tok("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    long = (prompts_of(demo, 1, random.Random(3))[0] * 20)[:120]
    tags, events, steps = {}, [], []
    b = Batcher(demo, max_rows=4, max_tokens=24, on_token=lambda row, e: events.append(tags[id(row)]),
                on_finish=lambda row: None)
    for tag, prompt, n in (("short", short, 30), ("long", long, 2)):
        row = Row(prompt, SamplingParams(n), demo)
        tags[id(row)] = tag
        b.add(row)
        steps.append(b.step())
    while not b.idle:
        steps.append(b.step())
    before_long = events[:events.index("long")]
    assert before_long.count("short") >= 120 // 24 - 1, events  # a token per step while the prompt prefilled
    assert all(s.tokens <= 24 for s in steps)


def fail_the_prompts_step(engine, module, monkeypatch, tiny) -> list[Row]:
    """Two rows whose prompts end in the first step, which fails in sampling (patched in `module`);
    returns the rows engine.reset() must answer."""
    rows = [Row([5, 6, 7], SamplingParams(4), tiny), Row([8, 9], SamplingParams(4), tiny)]
    for row in rows:
        engine.add(row)

    def broken(logits, rows):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    monkeypatch.setattr(module, "sample_rows", broken)
    with pytest.raises(RuntimeError):
        engine.step()                                   # the whole prompts in one chunk: the prefill ends here
    return rows


def test_a_failed_step_at_the_end_of_a_prefill_keeps_its_rows_for_reset(tiny, monkeypatch) -> None:
    """Found with the OpenAI routes: a sampling error on the step that ended a group's prefill lost
    the group's rows (neither running nor the group), so reset() never answered them: a hang."""
    b = Batcher(tiny, max_rows=4, max_tokens=64, on_token=lambda row, e: None, on_finish=lambda row: None)
    rows = fail_the_prompts_step(b, batcher, monkeypatch, tiny)
    assert sorted(map(id, b.reset())) == sorted(map(id, rows)) and b.idle
