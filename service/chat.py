"""OpenAI-style chat on top of the TGI path: the model's embedded chat template makes the prompt;
each of the `n` choices is one engine request, and their results become a ChatCompletion (or a
stream of chunks, one choice after the other, with usage last when asked for, ending in `[DONE]`)."""
from __future__ import annotations

from collections.abc import AsyncIterator

import jinja2

from . import inference, openai_api
from .engine.sampling import Finished, TokenEvent
from .errors import TemplateFailed, ValidationFailed
from .model.build import ServedModel
from .registry import ModelRegistry
from .schemas.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatRequest,
    ChatTokenLogprob,
    TopLogprob,
)
from .settings import Settings

async def templated(req: ChatRequest, registry: ModelRegistry) -> tuple[str, str]:
    """The model the request names, and the prompt its chat template makes of the messages
    (special tokens written in the text: it is tokenized without adding any)."""
    lease = registry.acquire(registry.resolve(openai_api.model_of(req, registry)))
    try:
        tokenizer = lease.served.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValidationFailed(f"model {lease.entry.name!r} has no chat template", param="messages")
        try:
            return lease.entry.name, await inference.off_loop(tokenizer.apply_chat_template,
                                                              [m.for_template() for m in req.messages],
                                                              tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise TemplateFailed(f"Template error: {e}", param="messages") from None
    finally:
        lease.release()


async def start(req: ChatRequest, registry: ModelRegistry, settings: Settings) -> list[inference.Started]:
    params = openai_api.sampling(req, settings, req.new_tokens(), req.top_n())
    name, prompt = await templated(req, registry)
    return await inference.start_many(registry, settings, name, [prompt], params, req.choices(), stream=req.stream,
                                      special=False, fields=("messages", req.new_tokens_field()),
                                      grammar_field="response_format",
                                      grammar=req.response_format.spec() if req.response_format else None)


def _scored(served: ServedModel, as_id: bool | None, cls: type[TopLogprob], token: int, logprob: float,
            **more) -> TopLogprob:
    """One token with its own bytes, and its text or OpenAI's 'bytes:' form (openai_api.token_string),
    or with `as_id` (vLLM's return_tokens_as_token_ids) 'token_id:<id>'."""
    text, raw = openai_api.token_of(served, token, as_id)
    return cls(token=text, logprob=logprob, bytes=list(raw), **more)


def _logprobs(served: ServedModel, log: openai_api.TokenLog, text_end: int, as_id: bool | None) -> ChatLogprobs:
    events, _ = log.take(text_end)

    def top(e: TokenEvent) -> list[TopLogprob]:
        return [_scored(served, as_id, TopLogprob, i, lp) for i, lp in e.top]
    return ChatLogprobs(content=[_scored(served, as_id, ChatTokenLogprob, e.id, e.logprob, top_logprobs=top(e))
                                 for e in events])


def _choice(index: int, s: inference.Started, fin: Finished, req: ChatRequest) -> ChatChoice:
    text = openai_api.cut(fin, req)
    as_id = req.return_tokens_as_token_ids
    logprobs = _logprobs(s.served, openai_api.TokenLog(fin.tokens), len(text), as_id) if req.logprobs else None
    return ChatChoice(index=index, message=ChatMessage(content=text), finish_reason=openai_api.finish_reason(fin),
                      logprobs=logprobs)


def completion(started: list[inference.Started], fins: list[Finished], req: ChatRequest) -> ChatCompletion:
    return openai_api.response(ChatCompletion, "chatcmpl", started, fins, req, lambda *a: _choice(*a, req))


def chunks(started: list[inference.Started], firsts: list[TokenEvent | Finished],
           req: ChatRequest) -> AsyncIterator[bytes]:
    """Each choice's chunks, one choice after the other: one chunk per token (special tokens and
    stop sequences left out; with `logprobs`, each chunk's tokens), a last one with finish_reason;
    then the usage when `stream_options.include_usage`, then [DONE] (openai_api.stream)."""
    return openai_api.stream(started, firsts, req, lambda *a: _choice_chunks(*a, req=req),
                             openai_api.envelope(ChatCompletionChunk, "chatcmpl", started))


async def _choice_chunks(index: int, s: inference.Started, first: TokenEvent | Finished, fins: list[Finished], *,
                         req: ChatRequest) -> AsyncIterator[ChatChunkChoice]:
    """One choice's deltas as they come (held back at a possible stop sequence), then the rest with
    the finish reason; `fins` gets its result."""
    stop, log, sent = openai_api.stop_cut(req), openai_api.TokenLog() if req.logprobs else None, 0

    def delta(content: str, reason: str | None = None) -> ChatChunkChoice:
        nonlocal sent
        sent += len(content)
        return ChatChunkChoice(index=index, delta=ChatDelta(content=content), finish_reason=reason,
                               logprobs=_logprobs(s.served, log, sent, req.return_tokens_as_token_ids)
                               if log is not None else None)
    async for item in inference.events(s, first):
        if isinstance(item, Finished):
            yield delta(stop.finish(item.generated_text), openai_api.finish_reason(item))
            fins.append(item)
        else:
            if log is not None:
                log.add(item)
            if text := stop.feed(item.text, item.special):
                yield delta(text)
