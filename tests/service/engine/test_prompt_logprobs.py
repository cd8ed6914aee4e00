"""Prompt log-probabilities (SamplingParams.prompt_logprobs: TGI's decoder_input_details, OpenAI's
echo with logprobs) on both engines, on the CPU: each prompt token's log-probability given the
tokens before it equals log_softmax of llama.py's forward over the whole prompt, however the
prompt is cut into chunks and whatever it is batched with; the most likely tokens at each position
are the forward's; rows that do not ask are unchanged."""
from __future__ import annotations

import random

import pytest
import torch
from test_batching import load, prompts_of
from test_scheduler import generate, padded, paged

from service.engine import batcher, scheduler
from service.engine.sampling import Row, SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def tiny(tiny_archive):
    return load(tiny_archive, "tiny")


@torch.inference_mode()
def reference(served, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(prompt[i + 1] | prompt[:i + 1]) [S - 1] and every position's log-probabilities [S - 1, V]."""
    logp = served.model(input_ids=torch.tensor([prompt], device=served.device)).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(1, torch.tensor(prompt[1:], device=served.device)[:, None])[:, 0].cpu(), logp.cpu()


def check(row: Row) -> None:
    chosen, logp = reference(row.served, row.prompt_ids)
    prefill = row.prefill()
    assert [t.id for t in prefill] == row.prompt_ids and prefill[0].logprob is None and prefill[0].top == ()
    got = torch.tensor([t.logprob for t in prefill[1:]])
    torch.testing.assert_close(got, chosen, rtol=0, atol=2e-2)
    for t, want in zip(prefill[1:], logp):
        assert len(t.top) == TOP and [v for _, v in t.top] == sorted((v for _, v in t.top), reverse=True)
        ids, values = zip(*t.top)
        torch.testing.assert_close(torch.tensor(values), want[list(ids)], rtol=0, atol=2e-2)   # its own values
        assert values[0] >= float(want.max()) - 4e-2                                            # the likeliest


ENGINES = {"paged": paged, "padded": padded}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("budget", [7, 512], ids=["chunked", "whole"])
def test_prompt_logprobs_equal_the_whole_forward(tiny, engine, budget) -> None:
    """A scoring row beside a plain one; 7 tokens a step cut its prompt into several chunks."""
    prompts = prompts_of(tiny, 2, random.Random(11))
    scoring = Row(prompts[0], SamplingParams(4, prompt_logprobs=TOP), tiny)
    plain = Row(prompts[1], SamplingParams(4), tiny)
    together = generate(ENGINES[engine](tiny, max_tokens=budget), [scoring, plain], together=True)
    check(scoring)
    assert plain.prefill() == () and plain.prompt_scores == []
    alone = generate(ENGINES[engine](tiny), [Row(prompts[1], SamplingParams(4), tiny)], together=False)
    assert together[1] == alone[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_prompt_logits_a_step_are_capped(tiny, engine, monkeypatch) -> None:
    """PROMPT_LOGITS bounds the prompt positions whose logits one step keeps [n, V]: a prompt
    longer than it is scored over several steps, the same."""
    monkeypatch.setattr(scheduler, "PROMPT_LOGITS", 5)
    monkeypatch.setattr(batcher, "PROMPT_LOGITS", 5)
    prompt = prompts_of(tiny, 1, random.Random(5))[0]
    assert len(prompt) > 10
    e = ENGINES[engine](tiny)
    row = Row(prompt, SamplingParams(2, prompt_logprobs=TOP), tiny)
    e.add(row)
    steps = 0
    while not e.idle:
        e.step()
        steps += 1
    assert steps >= -(-(len(prompt)) // 5)
    check(row)


def test_the_first_event_and_the_result_carry_the_prefill(tiny) -> None:
    events = []
    e = paged(tiny)
    e.on_token = lambda row, event: events.append(event)
    row = Row(prompts_of(tiny, 1, random.Random(2))[0], SamplingParams(3, prompt_logprobs=0), tiny)
    generate(e, [row], together=False)
    assert events[0].prefill == row.prefill() and all(ev.prefill == () for ev in events[1:])
    assert row.finished().prefill == row.prefill() and all(t.top == () for t in row.prefill())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_row_of_no_new_tokens_only_scores_its_prompt(tiny, engine) -> None:
    """max_new_tokens 0 (OpenAI's echo with max_tokens 0): the row ends when its prompt is in,
    its length reached, with no token; a row beside it decodes on."""
    prompts = prompts_of(tiny, 2, random.Random(4))
    scoring = Row(prompts[0], SamplingParams(0, prompt_logprobs=TOP), tiny)
    plain = Row(prompts[1], SamplingParams(3), tiny)
    generate(ENGINES[engine](tiny, max_tokens=7), [scoring, plain], together=True)
    assert scoring.ids == [] and scoring.finish_reason == "length" and len(plain.ids) >= 1
    check(scoring)
    assert scoring.finished().tokens == [] and len(scoring.finished().prefill) == len(prompts[0])


def test_scores_out_of_order_are_a_bug(tiny) -> None:
    row = Row([1, 2, 3, 4], SamplingParams(1, prompt_logprobs=0), tiny)
    with pytest.raises(RuntimeError, match="out of order"):
        row.score_prompt(2, torch.zeros(1, 8))
