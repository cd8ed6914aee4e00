"""The generation loop's pieces on a stub model: sampling rules (TGI's), penalties, stops,
incremental detokenization, left padding."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from service.engine.logits import WATERMARK_DELTA, WATERMARK_KEY, _penalize, _warp, greenlist, sample
from service.engine.sampling import Row, SamplingParams, left_pad

EOS, SPECIAL = 9, frozenset({9})


class ByteTokenizer:
    """Token i is byte i (so multi-byte UTF-8 characters span tokens); 9 is the end token."""

    def decode(self, ids, skip_special_tokens=False):
        data = bytes(i for i in ids if not (skip_special_tokens and i in SPECIAL))
        return data.decode("utf-8", errors="replace")


def served() -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), tokenizer=ByteTokenizer(), eos_ids=frozenset({EOS}),
                           special_ids=SPECIAL)


def row(**params) -> Row:
    return Row([1, 2, 3], SamplingParams(**{"max_new_tokens": 50, **params}), served())


def test_sampling_turns_on_like_tgi() -> None:
    assert not SamplingParams(5).sampling and not SamplingParams(5, temperature=1.0).sampling
    assert SamplingParams(5, temperature=0.7).sampling and SamplingParams(5, top_k=3).sampling
    assert SamplingParams(5, top_p=0.9).sampling and SamplingParams(5, do_sample=True).sampling
    assert SamplingParams(5, typical_p=0.9).sampling and not SamplingParams(5, share_penalty=1.0).sampling


def test_greedy_takes_the_argmax_and_reports_its_logprob() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, -1.0])
    token, logprob, top = sample(logits, row())
    assert token == 1 and logprob == pytest.approx(float(logits.log_softmax(-1)[1])) and top == ()
    assert row().greedy and not row(top_n=2).greedy


def test_top_n_gives_the_most_likely_tokens_whatever_is_chosen() -> None:
    """top_n: the n most likely tokens with their log-probabilities, most likely first: on OpenAI's
    routes those of the model's distribution before the repetition penalty (vLLM's raw_logprobs;
    the chosen token's are the same), with `tgi` after it; never of the warped one a sample is
    drawn from; the chosen token need not be among them."""
    logits = torch.tensor([0.5, 4.0, -1.0, 3.0, 2.5])
    logprobs = logits.log_softmax(-1)
    token, logprob, top = sample(logits, row(top_n=3))
    assert token == 1 and [t for t, _ in top] == [1, 3, 4]
    assert [lp for _, lp in top] == pytest.approx([float(logprobs[i]) for i in (1, 3, 4)]) and logprob == top[0][1]
    penalized = logits.clone()
    penalized[1:4] = torch.tensor([2.0, -2.0, 1.5])                     # the prompt 1, 2, 3 penalized by 2
    token, logprob, top = sample(logits, row(top_n=2, repetition_penalty=2.0))
    assert token == 4 and [t for t, _ in top] == [1, 3] and logprob == pytest.approx(float(logprobs[4]))
    assert [lp for _, lp in top] == pytest.approx(logprobs[[1, 3]].tolist())
    token, logprob, top = sample(logits, row(top_n=2, repetition_penalty=2.0, tgi=True))
    assert token == 4 and [t for t, _ in top] == [4, 1]
    assert [lp for _, lp in top] == pytest.approx(penalized.log_softmax(-1)[[4, 1]].tolist())
    drawn = {sample(logits, row(top_n=1, do_sample=True, temperature=5.0, seed=s))[0] for s in range(40)}
    assert len(drawn) > 1                                                # sampled: not always the top token
    assert sample(logits, row(top_n=9))[2] == tuple(zip(logprobs.topk(5).indices.tolist(),
                                                         logprobs.topk(5).values.tolist()))   # at most V


def test_top_k_1_and_tiny_top_p_are_greedy_whatever_the_seed() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    for seed in range(5):
        assert sample(logits, row(do_sample=True, top_k=1, seed=seed))[0] == best
        assert sample(logits, row(do_sample=True, top_p=1e-6, seed=seed))[0] == best


def test_temperatures_and_top_p_under_float32s_range_are_greedy() -> None:
    """Found with the OpenAI routes: temperature 1e-300 (logits / 0 -> inf) or top_p 1e-300 (every
    token dropped) made softmax nan and failed the whole step."""
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    for params in ({"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}):
        assert sample(logits, row(do_sample=True, seed=0, **params))[0] == best, params


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.zeros(1000)
    a, b = row(do_sample=True, seed=11), row(do_sample=True, seed=11)
    assert [sample(logits, a)[0] for _ in range(5)] == [sample(logits, b)[0] for _ in range(5)]
    assert a.seed == 11 and row(do_sample=True).seed is not None and row().seed is None


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    r = row(repetition_penalty=2.0)                      # history: the prompt 1, 2, 3
    logits = torch.tensor([0.5, 4.0, -1.0, 3.0, 2.5])
    token, _, _ = sample(logits, r)
    assert token == 4                                     # 4.0 -> 2.0 and 3.0 -> 1.5 fall below 2.5


def test_repetition_penalty_is_transformers_and_stays_finite_at_any_penalty() -> None:
    """The logits of transformers' RepetitionPenaltyLogitsProcessor, bit for bit; penalties float32
    cannot take (1e-300 is 0 there: a seen logit / 0 was inf, 0 / 0 nan; 1e300 is inf: 0 * inf
    nan) leave finite logits, so that softmax, greedy's log-probability and a sample stay defined:
    such a sample raised, failing every row of the step."""
    from transformers import RepetitionPenaltyLogitsProcessor
    logits = torch.tensor([0.5, 4.0, -1.0, 0.0, 2.5, -3.0])
    history = torch.tensor([1, 2, 3, 5, 1])
    for penalty in (0.5, 1.3, 2.0):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(history[None], logits[None].clone())[0]
        assert torch.equal(_penalize(logits, history, SamplingParams(5, repetition_penalty=penalty)), theirs)
    for penalty in (1e-300, 1e-40, 1e300):
        shaped = _penalize(logits, history, SamplingParams(5, repetition_penalty=penalty))
        assert shaped.isfinite().all() and shaped[3] == 0 and shaped[0] == 0.5, (penalty, shaped)
        r = Row([1, 2, 3, 5], SamplingParams(5, repetition_penalty=penalty, do_sample=True, temperature=0.5,
                                             seed=0), served())
        token, logprob, _ = sample(logits, r)
        assert math.isfinite(logprob) and token == (1 if penalty < 1 else 4), (penalty, token)
        token, logprob, _ = sample(logits, row(repetition_penalty=penalty))
        assert math.isfinite(logprob) and token == (1 if penalty < 1 else 4), (penalty, token)


EXTREMES = {"temperature": [1e-300, 1e-5, 0.3, 1e30], "repetition_penalty": [1e-300, 1e-38, 1.5, 1e38, 1e300],
            "top_k": [1, 3], "top_p": [1e-300, 0.9], "typical_p": [1e-9, 0.95],
            "logit_bias": [((0, -100.0),), ((0, 100.0),)],
            "presence_penalty": [-2.0, 2.0], "frequency_penalty": [-2.0, 2.0], "share_penalty": [-2.0, 2.0],
            "watermark": [True], "do_sample": [True], "tgi": [True]}


def test_any_accepted_parameters_pick_a_token_with_a_finite_logprob() -> None:
    """Every combination of the extremes the routes accept, on flat to peaked logits: a token of
    the vocabulary and a finite log-probability, three tokens running (the penalties then see
    generated tokens). 223 of these 1500 raised or gave nan before the penalty was kept finite."""
    rng = random.Random(0)
    for trial in range(1500):
        logits = torch.randn(rng.choice([2, 5, 50]), generator=torch.Generator().manual_seed(trial))
        logits = logits * rng.choice([0.1, 3, 30, 1000])
        params = {k: rng.choice(v) for k, v in EXTREMES.items() if rng.random() < 0.4}
        r = Row([rng.randrange(len(logits)) for _ in range(4)], SamplingParams(5, seed=trial, **params), served())
        for _ in range(3):
            token, logprob, _ = sample(logits, r)
            assert 0 <= token < len(logits) and math.isfinite(logprob), (trial, params)
            r.push(token, logprob)


def test_openai_bias_and_penalties_shape_the_logits_of_generated_tokens_only() -> None:
    """logit_bias adds to a token's logit; presence and frequency penalties subtract, for the
    tokens generated so far (c[j] their count), not the prompt's; the log-probabilities given are
    the model's before them (vLLM's raw_logprobs: they were the shaped distribution's), and such
    a row is not plain greedy."""
    logits = torch.tensor([0.5, 4.0, -1.0, 3.0, 2.5])
    raw = logits.log_softmax(-1)
    r = row(logit_bias=((0, 10.0), (1, -100.0)), top_n=2)
    assert not r.greedy and row().greedy
    token, logprob, top = sample(logits, r)
    assert token == 0 and logprob == pytest.approx(float(raw[0])) and logprob < -3
    assert [t for t, _ in top] == [1, 3] and [v for _, v in top] == pytest.approx(raw[[1, 3]].tolist())
    r = row(presence_penalty=0.5, frequency_penalty=1.0)                   # prompt 1, 2, 3: no effect
    assert sample(logits, r)[0] == 1
    for t in (1, 1, 3):
        r.push(t, 0.0)
    counts = torch.tensor([0.0, 2, 0, 1, 0])
    shaped = logits - counts * 1.0 - (counts > 0).float() * 0.5            # 4.0 -> 1.5, 3.0 -> 1.5
    assert int(shaped.argmax()) == 4
    token, logprob, _ = sample(logits, r)
    assert token == 4 and logprob == pytest.approx(float(raw[4]))


def test_tgi_frequency_penalty_subtracts_each_tokens_share_of_prompt_and_generated() -> None:
    """TGI's frequency_penalty: mu[j] - share[j] * penalty, share[j] token j's count among the
    prompt's and the generated tokens over their number (TGI's routes: log-probabilities after
    it); a negative penalty favours repeats."""
    logits = torch.tensor([0.5, 4.0, -1.0, 3.0, 2.5])
    r = row(share_penalty=2.0, tgi=True)                                  # prompt 1, 2, 3
    assert not r.greedy
    for t in (1, 1, 1, 1):
        r.push(t, 0.0)
    counts = torch.tensor([0.0, 5, 1, 1, 0])                              # over 7 tokens
    shaped = logits - counts / 7 * 2.0                                    # 4.0 -> 2.57, 3.0 -> 2.71
    token, logprob, _ = sample(logits, r)
    assert token == 3 and logprob == pytest.approx(float(shaped.log_softmax(-1)[3]))
    r = row(share_penalty=-2.0, repetition_penalty=1.0)                  # 1.0: the repetition step a no-op
    logits = torch.tensor([2.8, 0.0, -1.0, 0.0, 2.5])
    assert sample(logits, r)[0] == 0
    for t in (4, 4, 4):
        r.push(t, 0.0)
    assert sample(logits, r)[0] == 4                                      # 2.5 + 2 * 3/6 = 3.5 > 2.8


def test_min_p_drops_what_is_under_min_p_times_the_top_probability_after_temperature() -> None:
    """vLLM's min_p: after temperature, a token whose probability is under min_p x the most likely
    one's is dropped (before top-k/p); a sampled token is always one of those kept; 0: none."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    for temperature, min_p in ((1.0, 0.3), (0.5, 0.3), (2.0, 0.5), (1.0, 1.0)):
        probs = (logits / temperature).softmax(-1)
        keep = probs >= min_p * probs.max()
        warped = _warp(logits, SamplingParams(5, temperature=temperature, min_p=min_p))
        assert torch.equal(warped.isfinite(), keep), (temperature, min_p)
        drawn = {sample(logits, row(temperature=temperature, min_p=min_p, do_sample=True, seed=s))[0]
                 for s in range(30)}
        assert drawn <= set(keep.nonzero()[:, 0].tolist()), (temperature, min_p, drawn)
    assert torch.equal(_warp(logits, SamplingParams(5, min_p=0.0)), logits)


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_what_transformers_typical_warper_keeps(mass) -> None:
    """typical_p (TGI's, through transformers' TypicalLogitsWarper): the same tokens kept, on
    peaked and flat logits, after top_k's -inf too; a sampled token is always one of them."""
    from transformers import TypicalLogitsWarper
    g = torch.Generator().manual_seed(int(mass * 100))
    for scale in (0.5, 3.0):
        logits = torch.randn(50, generator=g) * scale
        for top_k in (None, 20):
            ours = _warp(logits, SamplingParams(5, top_k=top_k, typical_p=mass))
            ref = logits.clone()
            if top_k:
                ref = ref.masked_fill(ref < torch.topk(ref, top_k).values[-1], float("-inf"))
            theirs = TypicalLogitsWarper(mass)(None, ref[None])[0]
            assert torch.equal(ours.isfinite(), theirs.isfinite()), (scale, top_k)
            assert torch.equal(ours[ours.isfinite()], logits[ours.isfinite()])
    kept = _warp(logits, SamplingParams(5, typical_p=mass)).isfinite()
    for seed in range(20):
        assert kept[sample(logits, row(typical_p=mass, seed=seed))[0]]


def test_watermark_favours_the_green_list_of_the_previous_token() -> None:
    """TGI's watermark: the green list after token t is the first half of randperm(V) drawn with
    seed KEY * t; its logits gain DELTA before greedy's argmax and before the log-probabilities. A
    red token that leads by less than DELTA loses to the best green one; by more, it stays."""
    v = 1000
    green = greenlist(3, v, torch.device("cpu"))                      # the prompt [1, 2, 3] ends with 3
    g = torch.Generator().manual_seed(WATERMARK_KEY * 3)
    assert torch.equal(green, torch.randperm(v, generator=g)[:v // 2]) and len(set(green.tolist())) == v // 2
    red = next(i for i in range(v) if i not in set(green.tolist()))
    logits = torch.zeros(v)
    logits[red], logits[int(green[7])] = 1.5, 0.5                     # red leads by 1.0 < DELTA
    token, logprob, _ = sample(logits, row(watermark=True, tgi=True))             # TGI's: reported after it
    assert token == int(green[7]) and not row(watermark=True).greedy
    marked = logits.clone()
    marked[green] += WATERMARK_DELTA
    assert logprob == pytest.approx(float(marked.log_softmax(-1)[token]))
    logits[red] = 0.5 + WATERMARK_DELTA + 0.5                         # leads by more than DELTA
    assert sample(logits, row(watermark=True))[0] == red
    w = row(watermark=True)
    w.push(5, 0.0)                                                    # then the list follows token 5
    assert sample(torch.zeros(v), w)[0] == int(greenlist(5, v, torch.device("cpu")).min())   # flat: the first green


def test_finish_reasons() -> None:
    r = row(max_new_tokens=2)
    r.push(ord("a"), 0.0)
    assert not r.done
    r.push(ord("b"), 0.0)
    assert r.finish_reason == "length"
    r = row()
    r.push(EOS, 0.0)
    assert r.finish_reason == "eos_token" and r.tokens[0].special and r.finished().generated_text == ""
    r = row(stop=("lo w",))
    for ch in "hello world":
        r.push(ord(ch), 0.0)
        if r.done:
            break
    assert r.finish_reason == "stop_sequence" and r.finished().generated_text == "hello w"


def test_the_last_allowed_token_ends_by_length_first_on_tgis_routes_only() -> None:
    """At max_new_tokens, a token that is also the EOS or ends a stop sequence: TGI's
    StoppingCriteria checks the length first ("length"); vLLM's check_stop the EOS first, and
    its stop strings override the length (OpenAI's routes: "stop" for both)."""
    for tgi, at_eos, at_stop in ((True, "length", "length"), (False, "eos_token", "stop_sequence")):
        r = row(max_new_tokens=2, tgi=tgi)
        r.push(ord("a"), 0.0)
        r.push(EOS, 0.0)
        assert r.finish_reason == at_eos, tgi
        r = row(max_new_tokens=2, stop=("ab",), tgi=tgi)
        r.push(ord("a"), 0.0)
        r.push(ord("b"), 0.0)
        assert r.finish_reason == at_stop, tgi
        r = row(max_new_tokens=3, stop=("ab",), tgi=tgi)      # before the length: the same on both
        r.push(ord("a"), 0.0)
        r.push(ord("b"), 0.0)
        assert r.finish_reason == "stop_sequence", tgi


def test_tgi_rows_report_the_warped_distributions_logprobs() -> None:
    """TGI's NextTokenChooser (and HeterogeneousNextTokenChooser) report log_softmax of the scores
    after temperature, top_k, top_p and typical_p, for the chosen token and top_n_tokens alike; a
    token a warper dropped is no alternative. vLLM's default (raw_logprobs), OpenAI's routes:
    before temperature. A greedy row has no warper: the same on both."""
    logits = torch.tensor([0.5, 4.0, -1.0, 3.0, 2.5])
    for params in ({"temperature": 0.5}, {"temperature": 2.0, "top_k": 2}, {"do_sample": True, "top_p": 0.6},
                   {"typical_p": 0.5}):
        warped = _warp(logits, SamplingParams(5, **params)).log_softmax(-1)
        token, logprob, top = sample(logits, row(top_n=5, seed=3, tgi=True, **params))
        kept = [(i, v) for i, v in zip(warped.topk(5).indices.tolist(), warped.topk(5).values.tolist())
                if v != -math.inf]
        assert logprob == pytest.approx(float(warped[token])) and [i for i, _ in top] == [i for i, _ in kept]
        assert [v for _, v in top] == pytest.approx([v for _, v in kept]), params
        raw = sample(logits, row(top_n=5, seed=3, **params))
        assert raw[0] == token and raw[1] == pytest.approx(float(logits.log_softmax(-1)[token])), params
        assert len(raw[2]) == 5
    assert sample(logits, row(top_n=2, tgi=True)) == sample(logits, row(top_n=2))


def test_incremental_text_never_splits_a_character() -> None:
    r = row()
    pieces = [r.push(b, 0.0).text for b in "é€x".encode()]
    assert pieces == ["", "é", "", "", "€", "x"] and r.finished().generated_text == "é€x"


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], 0, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
