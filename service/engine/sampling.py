"""One request's decoding state (`Row`) and how a token is chosen for it; the batching itself is
service/engine/.

    ids, mask   [B, S]    left-padded prompts, 1 where a token is real
    logits      [B, V]    float32, last position only

Sampling follows TGI: greedy unless `do_sample` or a warper (temperature != 1, top_k, top_p < 1,
typical_p < 1) is set; a sampled row gets a seed (the request's, or a random one that the details
report)."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from ..model.build import ServedModel
from .grammar import Constraint


TopN = tuple[tuple[int, float], ...]   # (token id, log-probability), most likely first
PROMPT_LOGITS = 256                    # prompt positions whose logits [n, V] float32 a step keeps at most
                                       # for prompt_logprobs (a 128k vocabulary: 128 MiB)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    do_sample: bool = False
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    top_n: int = 0                     # the most likely tokens reported beside each chosen one
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, added to its logit), OpenAI's
    presence_penalty: float = 0.0      # OpenAI's: subtracted from a generated token's logit
    frequency_penalty: float = 0.0     # OpenAI's: times its count among the generated tokens, subtracted
    typical_p: float | None = None     # TGI's typical decoding: the most typical tokens of this mass
    min_p: float | None = None         # vLLM's: tokens under min_p x the top one's probability dropped
    min_tokens: int = 0                # vLLM's: no EOS and no stop string before this many tokens
    ignore_eos: bool = False           # vLLM's: an EOS does not end the row
    share_penalty: float = 0.0         # TGI's frequency_penalty: times its share of all the row's tokens, subtracted
    watermark: bool = False            # TGI's: the green list after the previous token favoured (`_watermark`)
    grammar: object = None             # a compiled index (grammar.py: TGI's grammar, OpenAI's response_format)
    prompt_logprobs: int | None = None  # each prompt token's log-probability and this many most likely
                                        # tokens at its position (TGI's decoder_input_details, OpenAI's echo);
                                        # None: not computed
    default_length: bool = False       # max_new_tokens is the server's default, not the request's: at
                                       # most what the context leaves the prompt (inference.py)
    tgi: bool = False                  # TGI's conventions (its routes) over vLLM's (OpenAI's routes): the
                                       # length reached is the finish reason even at an EOS or a stop
                                       # (`Row.push`); log-probabilities after the warpers (`sample`)

    @property
    def sampling(self) -> bool:
        warped = self.temperature not in (None, 1.0) or bool(self.top_k) or (self.top_p or 1.0) < 1.0 \
            or (self.typical_p or 1.0) < 1.0
        return self.do_sample or warped

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty reads the row's tokens (TGI's repetition and frequency, OpenAI's presence
        and frequency): the row then keeps them on the device (Row.history)."""
        return bool(self.repetition_penalty or self.share_penalty or self.presence_penalty or self.frequency_penalty)

    @property
    def shaped(self) -> bool:
        """Whether OpenAI's logit_bias or presence/frequency penalties change the logits."""
        return bool(self.logit_bias) or bool(self.presence_penalty) or bool(self.frequency_penalty)


@dataclass(frozen=True)
class PromptToken:
    """A prompt token with its log-probability given the tokens before it (None for the first)
    and the most likely tokens at its position: the model's distribution as it is (no penalty,
    bias or warper)."""
    id: int
    logprob: float | None
    top: TopN = ()


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str
    logprob: float
    special: bool
    top: TopN = ()                     # top_n: the most likely tokens
    prefill: tuple[PromptToken, ...] = ()   # the first event of a row with prompt_logprobs: its prompt


@dataclass(frozen=True)
class Finished:
    generated_text: str
    finish_reason: str | None          # "length" | "eos_token" | "stop_sequence"; None: cancelled
    tokens: list[TokenEvent]
    seed: int | None
    input_length: int
    prefill: tuple[PromptToken, ...] = ()   # with prompt_logprobs


class Detokenizer:
    """Token ids to text piece by piece (TGI's incremental decode): a token's piece is the text it
    completes, "" while a UTF-8 sequence is unfinished (the piece then comes with a later token)."""

    def __init__(self, decode):
        self.decode, self.ids = decode, []
        self._prefix = self._read = 0           # the window's start, and the end of what was given

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.decode(self.ids[self._prefix:self._read], skip_special_tokens=False)
        full = self.decode(self.ids[self._prefix:], skip_special_tokens=False)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full[len(prefix):]
        return ""


class Row:
    """One request's decoding state: its tokens, its text so far, and why it stopped."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, served: ServedModel, owner=None):
        self.prompt_ids, self.params, self.served, self.owner = prompt_ids, params, served, owner
        self.ids: list[int] = []
        self.tokens: list[TokenEvent] = []
        self.text = ""                          # special tokens kept: what stop sequences see
        self.finish_reason: str | None = None
        self.cancelled = False
        self.error: str | None = None           # why choosing its token failed (`sample_rows`): it ends
        self.admitted_at: float | None = None   # perf_counter when a batch took it (`admit`)
        self.detokenizer = Detokenizer(served.tokenizer.decode)
        self.prompt_scores: list[tuple[float, TopN]] = []    # prompt_logprobs: positions 1, 2, ... so far
        self.seed = (params.seed if params.seed is not None else random.getrandbits(63)) \
            if params.sampling else None
        self.generator = torch.Generator(served.device).manual_seed(self.seed) if self.seed is not None else None
        self.history = torch.tensor(prompt_ids, device=served.device) \
            if params.counts_tokens else None                                   # [T]: prompt and generated
        self.constraint = Constraint(params.grammar) if params.grammar is not None else None
        self.eos = torch.tensor(sorted(served.eos_ids), dtype=torch.long, device=served.device) \
            if params.min_tokens and served.eos_ids else None                   # masked before min_tokens
        self.bias = None                        # logit_bias as (ids, values) on the device, made once
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = (torch.tensor(ids, device=served.device), torch.tensor(values, device=served.device))

    def admit(self) -> Row:
        """Marks the row taken into the running batch, now; returns it."""
        self.admitted_at = time.perf_counter()
        return self

    @property
    def greedy(self) -> bool:
        """Its token is the argmax of the model's logits as they are (no sampling, no penalty or
        bias), and nothing else is read from them (no top_n)."""
        p = self.params
        return self.history is None and not p.sampling and not p.top_n and not p.shaped and not p.watermark \
            and self.constraint is None and not self.holds_eos

    @property
    def holds_eos(self) -> bool:
        """Whether its EOS tokens are masked now: fewer than min_tokens generated (vLLM's)."""
        return self.eos is not None and len(self.ids) < self.params.min_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled or self.error is not None

    def score_prompt(self, start: int, logits: torch.Tensor) -> None:
        """Logits [n, V] (float32) at prompt positions start .. start + n - 1, in order: each gives
        the log-probability of the prompt token after it and the prompt_logprobs most likely tokens
        there (the last position's next token is generated, not scored)."""
        if start != len(self.prompt_scores):
            raise RuntimeError(f"prompt position {start} scored out of order ({len(self.prompt_scores)} so far)")
        n = min(len(logits), len(self.prompt_ids) - 1 - start)
        if n <= 0:
            return
        logp = logits[:n].log_softmax(-1)                                            # [n, V]
        following = torch.tensor(self.prompt_ids[start + 1:start + 1 + n], device=logp.device)
        chosen = logp.gather(1, following[:, None])[:, 0].tolist()
        k = min(self.params.prompt_logprobs or 0, logp.shape[-1])
        tops: list[TopN] = [()] * n
        if k:
            values, ids = logp.topk(k, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        self.prompt_scores.extend(zip(chosen, tops))

    def prompt_in(self) -> None:
        """Its whole prompt has gone in: a row that only scores it (max_new_tokens 0, prompt_logprobs)
        ends here, its length reached, without a token."""
        if self.params.max_new_tokens == 0:
            self.finish_reason = "length"

    def prefill(self) -> tuple[PromptToken, ...]:
        """The prompt's tokens with their scores (empty without prompt_logprobs)."""
        if self.params.prompt_logprobs is None:
            return ()
        first = PromptToken(self.prompt_ids[0], None)
        return (first, *(PromptToken(t, lp, top) for t, (lp, top) in zip(self.prompt_ids[1:], self.prompt_scores)))

    def push(self, token: int, logprob: float, top: TopN = ()) -> TokenEvent:
        self.ids.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.history is not None:
            self.history = torch.cat([self.history, self.history.new_tensor([token])])
        piece = self.detokenizer.add(token)
        self.text += piece
        event = TokenEvent(token, piece, logprob, token in self.served.special_ids, top,
                           self.prefill() if len(self.ids) == 1 else ())
        self.tokens.append(event)
        self.finish_reason = self._stop(token, piece)
        return event

    def _stop(self, token: int, piece: str) -> str | None:
        """Why the row ends with `token` (whose text is `piece`), or None. At its last allowed token
        that is also an EOS or ends a stop sequence, TGI's StoppingCriteria checks the length first
        ("length"); vLLM's check_stop the EOS first and its detokenizer's stop strings override
        the length ("stop" both, on OpenAI's routes)."""
        p = self.params
        length = "length" if len(self.ids) >= p.max_new_tokens else None
        if p.tgi and length or len(self.ids) < p.min_tokens:       # vLLM checks no stop before min_tokens
            return length
        if token in self.served.eos_ids and not p.ignore_eos:
            return "eos_token"
        longest = max((len(s) for s in p.stop), default=0)
        window = self.text[max(0, len(self.text) - len(piece) - longest + 1):]   # a stop ending in `piece`
        if any(s in window for s in p.stop):
            return "stop_sequence"
        return length

    def finished(self) -> Finished:
        text = self.served.tokenizer.decode(self.ids, skip_special_tokens=True)
        return Finished(text, self.finish_reason, self.tokens, self.seed, len(self.prompt_ids), self.prefill())


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


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)      # [B, S]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


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
