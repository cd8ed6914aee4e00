"""How a row's token is chosen from the step's logits, as TGI chooses it: penalties, logit bias,
TGI's watermark, a grammar's mask, then greedy, or the warpers (temperature, top_k, top_p,
typical_p) and a seeded draw; plain greedy rows in one batched argmax (`sample_rows`). A row is
sampling.py's `Row`.

    logits      [B, V]    float32, last position only
"""
from __future__ import annotations

import math

import torch

from .sampling import Row, SamplingParams, TopN


MIN_TEMPERATURE = 1e-5         # below it, float32 logits / temperature overflow to inf (and softmax to nan)
LOGIT_LIMIT = 1e30             # what a penalized logit stays within: / MIN_TEMPERATURE still finite in float32


def _repeated(seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty of the seen tokens' logits [T]: divided by it when positive, times it
    when negative, 0 kept; within +-LOGIT_LIMIT, as float32 cannot take extreme penalties (1e-300
    is 0 there: x / 0 = inf, 0 / 0 = nan, and softmax then nan, which failed the batch's step);
    -inf (a token the grammar masked, on OpenAI's routes) kept."""
    scaled = torch.where(seen > 0, seen / penalty, seen * penalty).clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    return torch.where((seen == 0) | (seen == -math.inf), seen, scaled)      # a masked token stays masked


def _penalize(logits: torch.Tensor, history: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """TGI's repetition_penalty (`_repeated`), then TGI's frequency_penalty: mu[j] - share[j] *
    penalty, share[j] token j's count among the row's prompt and generated tokens over their number."""
    if p.repetition_penalty:
        logits = logits.scatter(0, history, _repeated(logits.gather(0, history), p.repetition_penalty))
    if p.share_penalty:
        counts = torch.bincount(history, minlength=logits.numel())[:logits.numel()].to(logits.dtype)
        logits = logits - counts / history.numel() * p.share_penalty
    return logits


def _shape(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """OpenAI's logit_bias, then mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty,
    c[j] the count of token j among the row's generated tokens (its prompt's do not count)."""
    p = row.params
    if row.bias is not None:
        ids, values = row.bias
        logits = logits.index_add(0, ids, values.to(logits.dtype))
    if (p.presence_penalty or p.frequency_penalty) and row.ids:
        counts = torch.bincount(row.history[len(row.prompt_ids):], minlength=logits.numel())
        counts = counts[:logits.numel()].to(logits.dtype)
        logits = logits - counts * p.frequency_penalty - (counts > 0).to(logits.dtype) * p.presence_penalty
    return logits


# TGI's watermark (Kirchenbauer et al. 2023, "A Watermark for Large Language Models"; TGI's defaults,
# its WATERMARK_GAMMA and WATERMARK_DELTA): the green list after token t is the first GAMMA of a
# permutation of the vocabulary drawn by a generator on the logits' device seeded with KEY * t; its
# logits gain DELTA. A detector that knows the scheme counts green tokens: z = (green - GAMMA n) /
# sqrt(n GAMMA (1 - GAMMA)).
WATERMARK_GAMMA, WATERMARK_DELTA, WATERMARK_KEY = 0.5, 2.0, 15485863


def greenlist(previous: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The watermark's green token ids after token `previous` [int(vocab * GAMMA)]."""
    g = torch.Generator(device).manual_seed(WATERMARK_KEY * previous)
    return torch.randperm(vocab, generator=g, device=device)[:int(vocab * WATERMARK_GAMMA)]


def _watermark(logits: torch.Tensor, row: Row) -> torch.Tensor:
    previous = row.ids[-1] if row.ids else row.prompt_ids[-1]
    return logits.index_add(0, greenlist(previous, logits.numel(), logits.device),
                            logits.new_full((int(logits.numel() * WATERMARK_GAMMA),), WATERMARK_DELTA))


def _warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / max(p.temperature, MIN_TEMPERATURE) if p.temperature else logits
    if p.min_p:                                         # vLLM's order: after temperature, before top-k/p
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p                         # mass before it >= top_p
        drop[0] = False                                 # the top token stays (a top_p under float32's range)
        logits = _drop(logits, order, drop)
    if p.typical_p is not None and p.typical_p < 1.0:
        logits = _typical(logits, p.typical_p)
    return logits


def _typical(logits: torch.Tensor, mass: float) -> torch.Tensor:
    """Typical decoding (Meister et al. 2022, TGI's typical_p): tokens ranked by how far their
    surprisal -log p is from the distribution's entropy; kept from the most typical on until their
    probabilities reach `mass` (the first always)."""
    logp = logits.log_softmax(-1)
    entropy = -(logp * logp.exp()).nansum()                            # -inf * 0 (a dropped token): skipped
    distance, order = (-logp - entropy).abs().sort()
    before = logits[order].softmax(-1).cumsum(-1) < mass                # [V], most typical first
    last = before.sum().clamp(max=logits.numel() - 1)                   # the token that reaches the mass
    drop = distance > distance.gather(0, last[None])
    drop[0] = False
    return _drop(logits, order, drop)


def _drop(logits: torch.Tensor, order: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """logits with -inf where `drop` [V] (in the ranking `order`) marks a token."""
    return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))


Pick = tuple[int, float, TopN]         # token, its log-probability, the top_n


def sample(logits: torch.Tensor, row: Row) -> Pick:
    """One token for one row from its logits [V] (processed, then warped: temperature, top-k/p,
    typical_p): (token, its log-probability, the top_n most likely tokens with theirs). Those are,
    on OpenAI's routes, vLLM's default raw_logprobs: the model's before the penalties, the bias
    and the warpers (after the grammar's mask, as vLLM's); with `tgi`, the warped scores' (TGI's).
    One log_softmax a row either way (the model's logits are kept, not computed again). A token
    ruled out (a grammar, a warper) is no alternative: the top_n then holds fewer, never a -inf."""
    p = row.params
    logits, scored = _processed(logits, row)
    if p.sampling:
        warped = _warp(logits, p)
        token = int(torch.multinomial(warped.softmax(-1), 1, generator=row.generator))
        logprobs = (warped if p.tgi else scored).log_softmax(-1)
    else:
        token = int(logits.argmax())
        logprobs = scored.log_softmax(-1)
    top = ()
    if p.top_n:
        values, ids = logprobs.topk(min(p.top_n, logprobs.numel()))
        top = tuple((i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != -math.inf)
    return token, float(logprobs[token]), top


def _processed(logits: torch.Tensor, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits [V] a token is chosen from, those reported when not warped). TGI's order:
    watermark, penalties, the grammar's mask, reported at the end; vLLM's: the grammar's mask,
    reported there, then the penalties and logit_bias."""
    p = row.params
    if not p.tgi and row.constraint is not None:
        logits = row.constraint.mask(logits)
    scored = logits
    if row.holds_eos:                  # vLLM's min_tokens, unless the EOS is all a grammar leaves (no sync)
        held = logits.index_fill(0, row.eos, float("-inf"))
        logits = torch.where(held.isfinite().any(), held, logits)
    if p.watermark:
        logits = _watermark(logits, row)
    if row.history is not None:
        logits = _penalize(logits, row.history, p)
    if p.shaped:
        logits = _shape(logits, row)
    if p.tgi and row.constraint is not None:
        logits = row.constraint.mask(logits)
    return logits, logits if p.tgi else scored


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> each row's argmax token [B] and its log-probability [B] (on the device)."""
    tokens = logits.argmax(-1)
    return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


def sample_rows(logits: torch.Tensor, rows: list[Row]) -> list[Pick | None]:
    """One pick per row from logits [B, V]: plain greedy rows with one argmax and one
    device-to-host copy between them, the others (sampling, penalties, bias, top_n) one by one with
    `sample`; None for a row whose sampling failed (`_alone`)."""
    plain = [i for i, r in enumerate(rows) if r.greedy]
    out: list[Pick | None] = [None] * len(rows)
    if plain:
        sub = logits[torch.tensor(plain, device=logits.device)] if len(plain) < len(rows) else logits   # [G, V]
        tokens, logprobs = greedy(sub)                                                                  # [G]
        for i, token, logprob in zip(plain, tokens.tolist(), logprobs.tolist()):
            out[i] = (token, logprob, ())
    return [o if o is not None else _alone(logits[i], rows[i]) for i, o in enumerate(out)]


def _alone(logits: torch.Tensor, row: Row) -> Pick | None:
    """`sample`, or None with `row.error` set when it raises: what a row's own parameters do to its
    logits (nan probabilities, say) fails that row, not the step's other rows."""
    try:
        return sample(logits, row)
    except RuntimeError as e:
        row.error = f"generation failed: choosing a token: {e}"
        return None
