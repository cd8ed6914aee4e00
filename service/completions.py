"""OpenAI's (legacy) completions on the same engine as the other routes: each candidate of a
request (`n`, or `best_of`, per prompt) is one engine request, so they batch with each other and
with every other route's. The result is a Completion with those choices, or a stream of chunks (one choice after
the other, each chunk naming its choice's index), the usage when asked for, then `[DONE]`."""
from __future__ import annotations

from collections.abc import AsyncIterator

from . import inference, openai_api
from .engine.sampling import Finished, TokenEvent
from .model.build import ServedModel
from .registry import ModelRegistry
from .schemas.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .settings import Settings


async def start(req: CompletionRequest, registry: ModelRegistry, settings: Settings) -> list[inference.Started]:
    params = openai_api.sampling(req, settings, req.max_tokens, req.logprobs or 0)
    return await inference.start_many(registry, settings, openai_api.model_of(req, registry), req.prompts(), params,
                                      req.candidates(), stream=req.stream, fields=("prompt", "max_tokens"))


def _logprobs(served: ServedModel, log: openai_api.TokenLog, text_end: int) -> CompletionLogprobs:
    events, offsets = log.take(text_end)

    def top(e: TokenEvent) -> dict[str, float]:
        alternatives = {}
        for t in inference.top_tokens(served, e):       # most likely first: of two with one text, the likelier
            alternatives.setdefault(t.text, t.logprob)
        return alternatives | ({} if e.text in alternatives else {e.text: e.logprob})
    return CompletionLogprobs(tokens=[e.text for e in events], token_logprobs=[e.logprob for e in events],
                              top_logprobs=[top(e) for e in events], text_offset=offsets)


def _choice(index: int, s: inference.Started, fin: Finished, req: CompletionRequest) -> CompletionChoice:
    text = (s.prompt if req.echo else "") + openai_api.cut(fin.generated_text, req.stops())
    logprobs = _logprobs(s.served, openai_api.TokenLog(fin.tokens), len(text)) if req.logprobs is not None else None
    return CompletionChoice(text=text, index=index, logprobs=logprobs, finish_reason=openai_api.finish_reason(fin))


def completion(started: list[inference.Started], fins: list[Finished], req: CompletionRequest) -> Completion:
    """The choices; with best_of, each prompt's n best candidates (usage counts them all)."""
    use = openai_api.usage(fins, req.candidates())
    k, n = req.candidates(), req.choices()
    if k > n:                                   # each prompt's n best of its k, best first
        kept = [i for p in range(0, len(fins), k)
                for i in sorted(range(p, p + k), key=lambda i: -_mean(fins[i]))[:n]]
        started, fins = [started[i] for i in kept], [fins[i] for i in kept]
    return openai_api.response(Completion, "cmpl", started, fins, req, lambda *a: _choice(*a, req), use)


def _mean(fin: Finished) -> float:
    """A candidate's mean log-probability a token: best_of's measure, as OpenAI's."""
    return sum(t.logprob for t in fin.tokens) / len(fin.tokens) if fin.tokens else float("-inf")


def chunks(started: list[inference.Started], firsts: list[TokenEvent | Finished],
           req: CompletionRequest) -> AsyncIterator[bytes]:
    return openai_api.stream(started, firsts, req, lambda *a: _prompt_chunks(*a, req=req),
                             openai_api.envelope(Completion, "cmpl", started))


async def _prompt_chunks(index: int, s: inference.Started, first: TokenEvent | Finished, fins: list[Finished], *,
                         req: CompletionRequest) -> AsyncIterator[CompletionChoice]:
    """One prompt's chunks: the prompt (echo), the text as it comes (held back at a possible stop
    sequence), then the rest with the finish reason; `fins` gets its result."""
    stop, sent = openai_api.StopCut(req.stops()), 0
    log = openai_api.TokenLog() if req.logprobs is not None else None
    if req.echo:
        yield CompletionChoice(text=s.prompt, index=index, finish_reason=None)
    async for item in inference.events(s, first):
        done = isinstance(item, Finished)
        if not done and log is not None:
            log.add(item)
        text = stop.flush() if done else ("" if item.special else stop.feed(item.text))
        sent += len(text)
        if text or done:
            yield CompletionChoice(text=text, index=index,
                                   logprobs=_logprobs(s.served, log, sent) if log is not None else None,
                                   finish_reason=openai_api.finish_reason(item) if done else None)
        if done:
            fins.append(item)
