"""OpenAI's (legacy) completions on the same engine as the other routes: each candidate of a
request (`n`, or `best_of`, per prompt) is one engine request, so they batch with each other and
with every other route's. The result is a Completion with those choices, or a stream of chunks (one choice after
the other, each chunk naming its choice's index), the usage when asked for, then `[DONE]`."""
from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable

from . import inference, openai_api
from .engine.sampling import Detokenizer, Finished, PromptToken, TokenEvent, TopN
from .model.build import ServedModel
from .registry import ModelRegistry
from .schemas.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .settings import Settings

Name = Callable[[int], str]                     # a token id -> its string in `tokens`


async def start(req: CompletionRequest, registry: ModelRegistry, settings: Settings) -> list[inference.Started]:
    params = openai_api.sampling(req, settings, req.max_tokens, req.logprobs or 0, req.prompt_logprobs())
    return await inference.start_many(registry, settings, openai_api.model_of(req, registry), req.prompts(), params,
                                      req.candidates(), stream=req.stream, fields=("prompt", "max_tokens"))


def _alternatives(name: Name, chosen: int, logprob: float, top: TopN) -> dict[str, float]:
    """top_logprobs at one position: the most likely tokens, most likely first, and the chosen one
    where it is not among them, each under its `token` string (the chosen one's is that of
    `tokens`); a token whose string another of them already has is keyed 'token_id:<id>' (vLLM's
    form), so that no token is lost."""
    scored = [*top, *([] if any(i == chosen for i, _ in top) else [(chosen, logprob)])]
    keys = {chosen: name(chosen)}
    for i, _ in scored:
        if i not in keys:
            key = name(i)
            keys[i] = f"token_id:{i}" if key in keys.values() else key
    return {keys[i]: lp for i, lp in scored}


def namer(served: ServedModel, req: CompletionRequest) -> Name:
    """A token's string in `tokens` and the keys of `top_logprobs`: its text, or 'token_id:<id>'
    with vLLM's return_tokens_as_token_ids."""
    return lambda token: openai_api.token_of(served, token, req.return_tokens_as_token_ids)[0]


def _logprobs(name: Name, log: openai_api.TokenLog, text_end: int, at: int = 0) -> CompletionLogprobs:
    """The generated tokens' that start before text_end (of the completion), offsets from `at`."""
    events, offsets = log.take(text_end)
    return CompletionLogprobs(tokens=[name(e.id) for e in events],
                              token_logprobs=[e.logprob for e in events],
                              top_logprobs=[_alternatives(name, e.id, e.logprob, e.top) for e in events],
                              text_offset=[at + o for o in offsets])


def _prompt_logprobs(served: ServedModel, name: Name, prefill: tuple[PromptToken, ...]) -> CompletionLogprobs:
    """An echoed prompt's tokens (special tokens kept) with their log-probabilities, the first
    with none; offsets from the pieces of the prompt's incremental decode."""
    detok = Detokenizer(served.tokenizer.decode)
    pieces = [detok.add(t.id) for t in prefill]
    offsets = list(itertools.accumulate((len(x) for x in pieces[:-1]), initial=0)) if pieces else []
    tops = [None if t.logprob is None else _alternatives(name, t.id, t.logprob, t.top) for t in prefill]
    return CompletionLogprobs(tokens=[name(t.id) for t in prefill],
                              token_logprobs=[t.logprob for t in prefill], top_logprobs=tops, text_offset=offsets)


def _choice(index: int, s: inference.Started, fin: Finished, req: CompletionRequest) -> CompletionChoice:
    completion = openai_api.cut(fin, req)
    at = len(s.prompt) if req.echo else 0
    logprobs = None
    if req.logprobs is not None:
        name = namer(s.served, req)
        logprobs = _logprobs(name, openai_api.TokenLog(fin.tokens), len(completion), at)
        logprobs = _prompt_logprobs(s.served, name, fin.prefill) + logprobs if req.echo else logprobs
    return CompletionChoice(text=(s.prompt if req.echo else "") + completion, index=index, logprobs=logprobs,
                            finish_reason=openai_api.finish_reason(fin))


def completion(started: list[inference.Started], fins: list[Finished], req: CompletionRequest) -> Completion:
    """The choices; with best_of, each prompt's n best candidates (usage counts them all)."""
    use = openai_api.usage(fins, req.candidates())
    k, n = req.candidates(), req.choices()
    if k > n:                                   # each prompt's n best of its k, best first
        kept = [i for p in range(0, len(fins), k)
                for i in sorted(range(p, p + k), key=lambda i: -inference.mean_logprob(fins[i]))[:n]]
        started, fins = [started[i] for i in kept], [fins[i] for i in kept]
    return openai_api.response(Completion, "cmpl", started, fins, req, lambda *a: _choice(*a, req), use)


def chunks(started: list[inference.Started], firsts: list[TokenEvent | Finished],
           req: CompletionRequest) -> AsyncIterator[bytes]:
    return openai_api.stream(started, firsts, req, lambda *a: _prompt_chunks(*a, req=req),
                             openai_api.envelope(Completion, "cmpl", started))


async def _prompt_chunks(index: int, s: inference.Started, first: TokenEvent | Finished, fins: list[Finished], *,
                         req: CompletionRequest) -> AsyncIterator[CompletionChoice]:
    """One prompt's chunks: the prompt (echo), the text as it comes (held back at a possible stop
    sequence), then the rest with the finish reason; `fins` gets its result."""
    stop, sent = openai_api.stop_cut(req), 0
    log = openai_api.TokenLog() if req.logprobs is not None else None
    at, name = len(s.prompt) if req.echo else 0, namer(s.served, req)
    if req.echo:
        yield CompletionChoice(text=s.prompt, index=index, finish_reason=None,
                               logprobs=_prompt_logprobs(s.served, name, first.prefill) if log is not None else None)
    async for item in inference.events(s, first):
        done = isinstance(item, Finished)
        if not done and log is not None:
            log.add(item)
        text = stop.finish(item.generated_text) if done else stop.feed(item.text, item.special)
        sent += len(text)
        if text or done:
            yield CompletionChoice(text=text, index=index,
                                   logprobs=_logprobs(name, log, sent, at) if log is not None else None,
                                   finish_reason=openai_api.finish_reason(item) if done else None)
        if done:
            fins.append(item)
