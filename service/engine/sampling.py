"""One request's decoding state (`Row`): its parameters, its tokens and stops, its events; how a
token is chosen from its logits is logits.py, the batching itself service/engine/.

    ids, mask   [B, S]    left-padded prompts, 1 where a token is real
    logits      [B, V]    float32, last position only

Sampling follows TGI: greedy unless `do_sample` or a warper (temperature != 1, top_k, top_p < 1,
typical_p < 1) is set; a sampled row gets a seed (the request's, or a random one that the details
report)."""
from __future__ import annotations

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
    cached_tokens: int = 0                  # of the input, found in the prefix cache


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
        self.cached_tokens = 0                  # of its prompt, found in the prefix cache (blocks.py)
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
        return Finished(text, self.finish_reason, self.tokens, self.seed, len(self.prompt_ids), self.prefill(),
                        self.cached_tokens)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)      # [B, S]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask
