"""OpenAI-style chat on top of the TGI path: the model's embedded chat template makes the prompt;
the engine's result becomes a ChatCompletion (or a stream of chunks, with usage last when asked
for, ending in `[DONE]`)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from . import inference, openai_api
from .engine.sampling import Finished, TokenEvent
from .errors import ServiceError, ValidationFailed, openai_error_event
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

def templated(req: ChatRequest, registry: ModelRegistry) -> tuple[str, str]:
    """The model the request names, and the prompt its chat template makes of the messages
    (special tokens written in the text: it is tokenized without adding any)."""
    lease = registry.acquire(registry.resolve(openai_api.model_of(req, registry)))
    try:
        tokenizer = lease.served.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValidationFailed(f"model {lease.entry.name!r} has no chat template", param="messages")
        return lease.entry.name, tokenizer.apply_chat_template([m.for_template() for m in req.messages],
                                                               tokenize=False, add_generation_prompt=True)
    finally:
        lease.release()


async def start(req: ChatRequest, registry: ModelRegistry, settings: Settings) -> inference.Started:
    params = openai_api.sampling(req, settings, req.new_tokens(), req.top_n())
    name, prompt = templated(req, registry)
    return await inference.start(registry, settings, name, prompt, params, stream=req.stream,
                                 special=False, fields=("messages", "max_tokens"))


def _logprobs(served: ServedModel, log: openai_api.TokenLog, text_end: int) -> ChatLogprobs:
    events, _ = log.take(text_end)

    def top(e: TokenEvent) -> list[TopLogprob]:
        return [TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.text.encode()))
                for t in inference.top_tokens(served, e)]
    return ChatLogprobs(content=[ChatTokenLogprob(token=e.text, logprob=e.logprob, bytes=list(e.text.encode()),
                                                  top_logprobs=top(e)) for e in events])


def completion(started: inference.Started, fin: Finished, req: ChatRequest) -> ChatCompletion:
    text = openai_api.cut(fin.generated_text, req.stops())
    logprobs = _logprobs(started.served, openai_api.TokenLog(fin.tokens), len(text)) if req.logprobs else None
    choice = ChatChoice(index=0, message=ChatMessage(content=text), finish_reason=openai_api.finish_reason(fin),
                        logprobs=logprobs)
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=started.model,
                          system_fingerprint=openai_api.FINGERPRINT, choices=[choice], usage=openai_api.usage([fin]))


async def chunks(started: inference.Started, first: TokenEvent | Finished, req: ChatRequest) -> AsyncIterator[bytes]:
    """One chunk per token (special tokens and stop sequences left out; with `logprobs`, each
    chunk's tokens), a last one with finish_reason, the usage when
    `stream_options.include_usage`, then [DONE]."""
    cid, created, stop = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), openai_api.StopCut(req.stops())
    log, sent = openai_api.TokenLog() if req.logprobs else None, 0

    def chunk(content: str | None, reason: str | None = None, fin: Finished | None = None) -> bytes:
        nonlocal sent
        choices = []
        if content is not None:
            sent += len(content)
            choices = [ChatChunkChoice(index=0, delta=ChatDelta(content=content), finish_reason=reason,
                                       logprobs=_logprobs(started.served, log, sent) if log is not None else None)]
        return inference.sse(ChatCompletionChunk(id=cid, created=created, model=started.model,
                                                 system_fingerprint=openai_api.FINGERPRINT, choices=choices,
                                                 usage=openai_api.usage([fin]) if fin else None))
    try:
        async for item in inference.events(started, first):
            if isinstance(item, Finished):
                yield chunk(stop.flush(), openai_api.finish_reason(item))
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk(None, fin=item)
            else:
                if log is not None:
                    log.add(item)
                if not item.special and (text := stop.feed(item.text)):
                    yield chunk(text)
    except ServiceError as e:
        yield inference.sse(openai_error_event(e))
    yield inference.sse("[DONE]")
