"""What OpenAI's chat and completions routes share on top of inference.py: the model a request
names, its sampling parameters (a field this server cannot honour is refused, never ignored),
the text cut before the first stop sequence (OpenAI leaves the stop out; TGI keeps it), and the
pieces of a response (finish reason, usage, the envelope) and of a stream."""
from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable

import codec
from pydantic import BaseModel

from . import inference
from .engine.sampling import Finished, SamplingParams, TokenEvent
from .errors import ModelNotFound, ServiceError, UnsupportedParameter, ValidationFailed, internal, openai_error_event
from .model.build import ServedModel
from .registry import ModelRegistry
from .schemas.openai import OpenAIRequest, PromptTokensDetails, Usage
from .settings import Settings

log = logging.getLogger(__name__)
FINGERPRINT = f"wcodec-{codec.__version__}"          # every response's system_fingerprint
# what TGI's clients send for a server that ignores `model` (huggingface_hub: "dummy", older "tgi")
PLACEHOLDERS = ("tgi", "dummy")


def named(model: str | None) -> str | None:
    """The model a request's `model` names: None (the default model) for none or a placeholder."""
    return None if not model or model in PLACEHOLDERS else model


def model_of(req: OpenAIRequest, registry: ModelRegistry) -> str | None:
    """The store's model the request names; None (the default model) for none or a placeholder; else 404."""
    if named(req.model) is None:
        return None
    if not registry.has(req.model):
        raise ModelNotFound(f"the model {req.model!r} does not exist (GET /v1/models lists them)", param="model")
    return req.model


def sampling(req: OpenAIRequest, settings: Settings, max_tokens: int | None, top_n: int = 0,
             prompt_logprobs: int | None = None) -> Callable[[ServedModel], SamplingParams]:
    """The request's sampling parameters for the model it is leased (inference.start): checked
    now (a field this server cannot honour is a 400 before any model is needed); the model's
    generation_config fills what the request leaves out (`defaulted`). `top_n`: the alternatives
    each token's log-probabilities list (chat's top_logprobs, completions' logprobs)."""
    if bad := req.unsupported():
        raise UnsupportedParameter(*next(iter(bad.items())))
    if max_tokens is not None and (req.min_tokens or 0) > max_tokens:
        raise ValidationFailed(f"`min_tokens` ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                               param="min_tokens")
    stops = tuple(s for s in (inference.unicode_text(stop, "stop") for stop in req.stops()) if s)
    return functools.partial(defaulted, req, settings, max_tokens, top_n, prompt_logprobs, stops)


def defaulted(req: OpenAIRequest, settings: Settings, max_tokens: int | None, top_n: int, prompt_logprobs: int | None,
              stops: tuple[str, ...], served: ServedModel) -> SamplingParams:
    """vLLM's to_sampling_params: a field the request leaves out takes the model's default
    (`served.sampling_defaults`), else vLLM's neutral one: temperature 1 (OpenAI samples by
    default), no top-p, top-k, min-p or repetition penalty; max_tokens the model's max_new_tokens, else
    WCODEC_DEFAULT_MAX_NEW_TOKENS, cut to what the context leaves. Temperature 0: greedy, whatever
    top_p and top_k say, as OpenAI and vLLM (clients send it beside their default top_p)."""
    model = served.sampling_defaults

    def given(field: str):
        value = getattr(req, field)
        return model.get(field) if value is None else value
    temperature = given("temperature")
    temperature = 1.0 if temperature is None else temperature
    greedy = temperature == 0                                  # then no warper either
    top_p, top_k, min_p = (None, None, None) if greedy else (given("top_p"), given("top_k"), given("min_p"))
    penalty = given("repetition_penalty")
    bias = tuple((int(token), value) for token, value in (req.logit_bias or {}).items())
    limit = model.get("max_new_tokens", settings.default_max_new_tokens) if max_tokens is None else max_tokens
    limit = max(limit, req.min_tokens or 0)                    # an omitted max_tokens: at least min_tokens
    seed = None if req.seed is None else req.seed % 2**64                  # int64's negatives: two's complement
    return SamplingParams(int(limit), None if greedy else temperature, top_p, top_k if (top_k or 0) > 0 else None,
                          not greedy, seed, None if penalty in (None, 1.0) else penalty, stops, top_n, bias,
                          req.presence_penalty or 0.0, req.frequency_penalty or 0.0,
                          min_p=min_p or None, min_tokens=req.min_tokens or 0, ignore_eos=bool(req.ignore_eos),
                          prompt_logprobs=prompt_logprobs, default_length=max_tokens is None)


def envelope(cls: type[BaseModel], prefix: str, started: list[inference.Started]) -> Callable[..., BaseModel]:
    """`make(choices, usage)` of a response, or of each chunk of one stream: the fields they share
    (id, created, model, system_fingerprint) fixed once."""
    shared = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": started[0].model,
              "system_fingerprint": FINGERPRINT}
    return lambda choices, use: cls(choices=choices, usage=use, **shared)


def response(cls: type[BaseModel], prefix: str, started: list[inference.Started], fins: list[Finished],
             req: OpenAIRequest, choice: Callable[[int, inference.Started, Finished], BaseModel],
             use: Usage | None = None) -> BaseModel:
    """A whole (not streamed) response: `choice(index, started, fin)` of each choice, and the usage
    (`use`, else that of `fins`)."""
    choices = [choice(i, s, f) for i, (s, f) in enumerate(zip(started, fins))]
    return envelope(cls, prefix, started)(choices, use or usage(fins, req.choices()))


async def stream(started: list[inference.Started], firsts: list[TokenEvent | Finished], req: OpenAIRequest,
                 choice_chunks: Callable[..., AsyncIterator[BaseModel]],
                 chunk: Callable[[list[BaseModel], Usage | None], BaseModel]) -> AsyncIterator[bytes]:
    """A stream's events: each choice's chunks one choice after the other (`choice_chunks(index,
    started, first, fins)` yields a choice's pieces and appends its result to `fins`; `chunk(choices,
    usage)` wraps them), a last chunk with the usage and no choices when
    `stream_options.include_usage`, an error event if generation or a chunk fails, then [DONE]. Whatever ends
    the stream (a client gone too) cancels the choices still generating."""
    fins: list[Finished] = []
    try:
        for index, (s, first) in enumerate(zip(started, firsts)):
            async for choice in choice_chunks(index, s, first, fins):
                yield inference.sse(chunk([choice], None))
        if req.stream_options and req.stream_options.include_usage:
            yield inference.sse(chunk([], usage(fins, req.choices())))
    except ServiceError as e:
        yield inference.sse(openai_error_event(e))
    except Exception as e:                      # a bug: logged, and the stream still ends as vLLM's does
        log.exception("an OpenAI stream failed")
        yield inference.sse(openai_error_event(internal(e)))
    finally:
        inference.cancel_all(started)
    yield inference.sse("[DONE]")


class StopCut:
    """The text before the first stop sequence (through it with `keep`: vLLM's
    include_stop_str_in_output). Streamed pieces are held back while the text's end could still be
    the start of a stop sequence. `after` tokens (vLLM's min_tokens - 1): a stop that ends within
    their text does not count, as vLLM checks no stop before min_tokens (sampling.Row._stop)."""

    def __init__(self, stops: list[str], keep: bool = False, after: int = 0):
        self.stops, self.held, self.stopped, self.fed = [s for s in stops if s], "", False, ""
        self.keep, self.after, self.floor = keep, after, 0       # floor: the characters of those tokens

    def feed(self, piece: str, special: bool = False) -> str:
        """The part of the text so far that is now sure to be returned (a token's piece; a special
        token's counts toward `after` and adds no text)."""
        if self.stopped:
            return ""
        self.fed += "" if special else piece
        self.held += "" if special else piece
        if self.after > 0:                                       # one of the tokens whose stops do not count
            self.after, self.floor = self.after - 1, len(self.fed)
        start = len(self.fed) - len(self.held)                   # where `held` starts in the text
        found = [(i, i + len(s) if self.keep else i) for i, s in
                 ((self.held.find(s, max(0, self.floor - start - len(s) + 1)), s) for s in self.stops) if i >= 0]
        if found:
            out, self.held, self.stopped = self.held[:min(found)[1]], "", True
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def finish(self, whole: str) -> str:
        """At the end, the rest: what of `whole` (the generation's text, as the answer not streamed
        has it) was not fed (a character the last tokens left unfinished, whose pieces held it
        back: U+FFFD there), then what is held."""
        rest = self.feed(whole[len(self.fed):]) if whole.startswith(self.fed) else ""
        return rest + self.flush()


class TokenLog:
    """Log-probabilities asked for: the generated tokens (special ones left out) whose first
    character is in the returned text, each with its offset; `take` hands out those not yet given."""

    def __init__(self, events: Iterable[TokenEvent] = ()):
        self.events: list[TokenEvent] = []
        self.offsets: list[int] = []
        self.end, self.given = 0, 0
        for e in events:
            self.add(e)

    def add(self, e: TokenEvent) -> None:
        if not e.special:
            self.events.append(e)
            self.offsets.append(self.end)
            self.end += len(e.text)

    def take(self, text_end: int) -> tuple[list[TokenEvent], list[int]]:
        """The tokens starting before `text_end` not given yet, and their offsets."""
        n = self.given
        while n < len(self.events) and self.offsets[n] < text_end:
            n += 1
        events, offsets, self.given = self.events[self.given:n], self.offsets[self.given:n], n
        return events, offsets


def token_string(raw: bytes) -> str:
    """OpenAI's `token` of a token's bytes: its text, or where the bytes are not UTF-8 on their own
    (a piece of a character) OpenAI's form, 'bytes:' and the bytes, printable ASCII as is and any
    other byte (the backslash too) as \\xNN: b' \\xf0\\x9f' is 'bytes: \\xf0\\x9f'."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


def token_of(served: ServedModel, token: int, as_id: bool | None = False) -> tuple[str, bytes]:
    """A token's `token` string ('token_id:<id>' with `as_id`, vLLM's return_tokens_as_token_ids)
    and its own bytes (never those of the text it completes)."""
    raw = served.token_bytes(token)
    return f"token_id:{token}" if as_id else token_string(raw), raw


def stop_cut(req: OpenAIRequest) -> StopCut:
    return StopCut(req.stops(), keep=bool(req.include_stop_str_in_output), after=max(0, (req.min_tokens or 0) - 1))


def cut(fin: Finished, req: OpenAIRequest) -> str:
    """The returned text of a whole (not streamed) choice: its tokens' pieces through the stream's
    StopCut, so that both agree where min_tokens holds the stops off."""
    c = stop_cut(req)
    if not c.after:
        return c.feed(fin.generated_text) + c.flush()
    head = "".join(c.feed(t.text, t.special) for t in fin.tokens)
    return head + c.finish(fin.generated_text)


def finish_reason(fin: Finished) -> str:
    return "length" if fin.finish_reason == "length" else "stop"


def usage(fins: list[Finished], n: int = 1) -> Usage:
    """`fins` n per prompt (as `start` makes them): a prompt's tokens count once, as OpenAI's, and
    its cached tokens as its first sequence found them."""
    prompt, completion = sum(f.input_length for f in fins[::n]), sum(len(f.tokens) for f in fins)
    cached = PromptTokensDetails(cached_tokens=sum(f.cached_tokens for f in fins[::n]))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=cached)
