"""TGI's responses from the engine's finished generations and events: /generate's body (best_of's
pick and details) and /generate_stream's SSE (inference.py starts the generations and reads them)."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from .engine.sampling import Finished, PromptToken, TokenEvent
from .errors import ServiceError, error_event, incomplete
from .inference import Started, events, mean_logprob, sse
from .model.build import ServedModel
from .schemas.tgi import (
    BestOfSequence,
    Details,
    GenerateParameters,
    GenerateResponse,
    PrefillToken,
    SequenceDetails,
    StreamDetails,
    StreamResponse,
    Token,
)

log = logging.getLogger(__name__)


def _token(e: TokenEvent) -> Token:
    return Token(id=e.id, text=e.text, logprob=e.logprob, special=e.special)


def top_tokens(served: ServedModel, e: TokenEvent | PromptToken) -> list[Token]:
    """The event's (or prompt token's) most likely tokens, each decoded on its own (as TGI does: a
    piece of a character reads as U+FFFD)."""
    return [Token(id=i, text=token_text(served, i), logprob=lp, special=i in served.special_ids) for i, lp in e.top]


def token_text(served: ServedModel, token: int) -> str:
    return served.tokenizer.decode([token], skip_special_tokens=False)


def prefill_tokens(served: ServedModel, fin: Finished) -> list[PrefillToken]:
    """TGI's details.prefill: each prompt token decoded on its own, with its log-probability."""
    return [PrefillToken(id=t.id, text=token_text(served, t.id), logprob=t.logprob) for t in fin.prefill]


def _text(started: Started, fin: Finished, full: bool | None) -> str:
    return started.prompt + fin.generated_text if full else fin.generated_text


def _details(cls: type[SequenceDetails], started: Started, fin: Finished, p: GenerateParameters,
             **extra) -> SequenceDetails:
    top = [top_tokens(started.served, t) for t in fin.tokens] if p.top_n_tokens else []
    return cls(finish_reason=fin.finish_reason, generated_tokens=len(fin.tokens), seed=fin.seed,
               prefill=prefill_tokens(started.served, fin), tokens=[_token(t) for t in fin.tokens], top_tokens=top,
               **extra)


def tgi_response(started: list[Started], fins: list[Finished], p: GenerateParameters) -> GenerateResponse:
    """The response to a request of len(started) sequences (best_of): the one of highest mean
    log-probability a token, as TGI's router picks it (the first of equals); with details (or
    decoder_input_details), the others in best_of_sequences."""
    best = max(range(len(fins)), key=lambda i: mean_logprob(fins[i]))
    details = None
    if p.details or p.decoder_input_details:     # TGI's rule: either asks for details
        others = [_details(BestOfSequence, s, f, p, generated_text=_text(s, f, p.return_full_text))
                  for i, (s, f) in enumerate(zip(started, fins)) if i != best]
        details = _details(Details, started[best], fins[best], p, best_of_sequences=others or None)
    return GenerateResponse(generated_text=_text(started[best], fins[best], p.return_full_text), details=details)


async def tgi_stream(started: Started, first: TokenEvent | Finished, p: GenerateParameters) -> AsyncIterator[bytes]:
    """TGI's SSE: one event per token; the last token's event carries generated_text, and details
    when asked for (`details`), as TGI's generate_stream. A failure after the first event ends
    the stream with TGI's error event: the service error's, or for any other exception (a bug,
    logged) an incomplete generation's. Whatever ends it cancels the generation."""
    pending, index = None, 0

    def event(e: TokenEvent, **last) -> bytes:
        return sse(StreamResponse(index=index, token=_token(e), top_tokens=top_tokens(started.served, e), **last))
    try:
        async for item in events(started, first):
            if isinstance(item, Finished):
                if pending is not None:
                    details = StreamDetails(finish_reason=item.finish_reason, generated_tokens=len(item.tokens),
                                            seed=item.seed, input_length=item.input_length) if p.details else None
                    yield event(pending, generated_text=_text(started, item, p.return_full_text), details=details)
                return
            if pending is not None:
                yield event(pending)
            pending, index = item, index + 1
    except ServiceError as e:
        yield sse(error_event(e))
    except Exception as e:
        log.exception("a TGI stream failed")
        yield sse(error_event(incomplete(e)))
    finally:
        started.request.cancel()
