"""OpenAI-style chat on top of the TGI path: the model's embedded chat template makes the prompt;
the engine's result becomes a ChatCompletion (or a stream of chunks ending in `[DONE]`)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import codec

from . import inference
from .errors import ServiceError, ValidationFailed, error_event
from .engine.sampling import Finished, SamplingParams, TokenEvent
from .registry import ModelRegistry
from .schemas.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ChatRequest,
    Usage,
)
from .settings import Settings

FINGERPRINT = f"wcodec-{codec.__version__}"


def _params(req: ChatRequest, settings: Settings) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > 4:
        raise ValidationFailed("`stop` takes at most 4 sequences")
    temperature = req.temperature or None                      # 0 means greedy
    return SamplingParams(req.max_tokens or settings.default_max_new_tokens, temperature, req.top_p, None,
                          temperature is not None, req.seed, None, tuple(s for s in stop if s))


async def start(req: ChatRequest, registry: ModelRegistry, settings: Settings, stream: bool) -> inference.Started:
    model = req.model if req.model and registry.has(req.model) else None      # TGI ignores it: "tgi"
    lease = registry.acquire(registry.resolve(model))
    try:
        tokenizer = lease.served.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValidationFailed(f"model {lease.entry.name!r} has no chat template")
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False,
                                               add_generation_prompt=True)
    finally:
        lease.release()
    return await inference.start(registry, settings, lease.entry.name, prompt, _params(req, settings),
                                 stream=stream, special=False)


def _reason(fin: Finished) -> str:
    return "length" if fin.finish_reason == "length" else "stop"


def completion(started: inference.Started, fin: Finished) -> ChatCompletion:
    usage = Usage(prompt_tokens=fin.input_length, completion_tokens=len(fin.tokens),
                  total_tokens=fin.input_length + len(fin.tokens))
    choice = ChatChoice(index=0, message=ChatMessage(role="assistant", content=fin.generated_text),
                        finish_reason=_reason(fin))
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=started.model,
                          system_fingerprint=FINGERPRINT, choices=[choice], usage=usage)


async def chunks(started: inference.Started, first: TokenEvent | Finished) -> AsyncIterator[bytes]:
    """One chunk per token (special tokens left out), a last one with finish_reason, then [DONE]."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(content: str, reason: str | None) -> bytes:
        choice = ChatChunkChoice(index=0, delta=ChatDelta(content=content), finish_reason=reason)
        return inference.sse(ChatCompletionChunk(id=cid, created=created, model=started.model,
                                                 system_fingerprint=FINGERPRINT, choices=[choice]))
    try:
        async for item in inference.events(started, first):
            if isinstance(item, Finished):
                yield chunk("", _reason(item))
            elif not item.special:
                yield chunk(item.text, None)
    except ServiceError as e:
        yield inference.sse(error_event(e))
    yield inference.sse("[DONE]")
