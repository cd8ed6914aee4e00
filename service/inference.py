"""Between the generation routes and the engine: pick the model, hold a lease on it for the
request's whole life (released by the engine when the request ends), validate and tokenize the
prompt, wait for the engine's events and stream them (TGI's response shapes: tgi.py; OpenAI's:
openai_api.py, chat.py, completions.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request

from .engine import GenRequest, RequestGroup
from .engine import grammar as constraints
from .errors import ClientClosed, QueueFull, ValidationFailed
from .engine.sampling import Finished, SamplingParams, TokenEvent
from .model.build import ServedModel
from .registry import ModelRegistry
from .schemas.tgi import GenerateParameters, SimpleToken
from .settings import Settings

# the thread that tokenizes prompts and renders chat templates (TGI's validation worker, one as
# /info's validation_workers says): seconds for a prompt of megabytes, which on the event loop
# stalled every other request and /health with it
VALIDATION_WORKERS = 1
VALIDATION = ThreadPoolExecutor(VALIDATION_WORKERS, thread_name_prefix="wcodec-validation")

# a request's sampling parameters, or what makes them of the model it is leased (OpenAI's routes:
# the model's generation_config fills what the request leaves out, openai_api.defaulted)
Params = SamplingParams | Callable[[ServedModel], SamplingParams]


@dataclass
class Started:
    model: str
    served: ServedModel
    request: GenRequest
    prompt: str


def check_truncate(truncate: int | None, settings: Settings) -> None:
    """TGI's rule and words: `truncate` is 1 to the input limit (its schema says minimum 1; 0 is
    refused here, where the limit is known, so that TGI's message can name it)."""
    if truncate is not None and not 0 < truncate <= settings.max_input_tokens:
        raise ValidationFailed(f"`truncate` must be strictly positive and less than {settings.max_input_tokens}. "
                               f"Given: {truncate}", param="truncate")


def sampling_params(p: GenerateParameters, settings: Settings, *, stream: bool = False) -> SamplingParams:
    p.check_limits(settings)
    check_truncate(p.truncate, settings)
    for stop in p.stop:
        unicode_text(stop, "stop")
    if bad := p.unsupported():
        raise ValidationFailed(f"not supported by this server: {', '.join(bad)}")
    if p.decoder_input_details and stream:       # TGI's rule
        raise ValidationFailed("`decoder_input_details` == true is not supported when streaming tokens",
                               param="decoder_input_details")
    params = SamplingParams(p.max_new_tokens or settings.default_max_new_tokens, p.temperature, p.top_p, p.top_k,
                            p.do_sample, p.seed, p.repetition_penalty, tuple(s for s in p.stop if s),
                            p.top_n_tokens or 0, typical_p=p.typical_p, share_penalty=p.frequency_penalty or 0.0,
                            prompt_logprobs=0 if p.decoder_input_details else None,
                            watermark=p.watermark, default_length=p.max_new_tokens is None, tgi=True)
    if (p.best_of or 1) > 1:                     # TGI's rules
        if stream:
            raise ValidationFailed("`best_of` != 1 is not supported when streaming tokens", param="best_of")
        if p.seed is not None:
            raise ValidationFailed("`seed` must not be set when `best_of` > 1", param="seed")
        if not params.sampling:
            raise ValidationFailed("you must use sampling when `best_of` is > 1", param="best_of")
    return params


def _tokenize(served: ServedModel, prompt: str | list[int], params: SamplingParams, truncate: int | None,
              settings: Settings, special: bool, inputs: str) -> list[int]:
    """The prompt's token ids: a text tokenized, or ids as given (OpenAI's token prompts), checked."""
    vocab = served.model.config.vocab_size
    if isinstance(prompt, str):
        _refuse_unread(served, prompt, truncate, settings, inputs)
        ids = served.tokenizer(unicode_text(prompt, inputs), add_special_tokens=special)["input_ids"]
    elif (outside := next((t for t in prompt if t >= vocab), None)) is not None:
        raise ValidationFailed(f"`{inputs}`: token {outside} is not in the model's vocabulary (0 to {vocab - 1})",
                               param=inputs)
    else:
        ids = list(prompt)
    ids = ids[-truncate:] if truncate else ids
    if not ids:
        raise ValidationFailed(f"`{inputs}` tokenizes to no tokens", param=inputs)
    if len(ids) > settings.max_input_tokens:
        raise ValidationFailed(f"`{inputs}` must have less than {settings.max_input_tokens} tokens. Given: {len(ids)}",
                               param=inputs)
    if params.logit_bias and (outside := max(i for i, _ in params.logit_bias)) >= vocab:
        raise ValidationFailed(f"`logit_bias`: token {outside} is not in the model's vocabulary (0 to "
                               f"{vocab - 1})", param="logit_bias")
    return ids


def _refuse_unread(served: ServedModel, text: str, truncate: int | None, settings: Settings, inputs: str) -> None:
    """Refuse a text that cannot fit without tokenizing it (seconds of the validation thread for a
    text of megabytes): a token stands for at most `served.longest_token` characters, so a text
    of more than twice max_input_tokens x that many (twice: for a normalizer that adds some) has
    more tokens than the limit. With `truncate` every text fits: it is tokenized."""
    limit, longest = settings.max_input_tokens, served.longest_token
    if truncate is None and longest and len(text) > 2 * limit * longest:
        raise ValidationFailed(f"`{inputs}` must have less than {limit} tokens. Given: more than "
                               f"{len(text) // (2 * longest)} ({len(text)} characters)", param=inputs)


def _within_context(served: ServedModel, ids: list[int], params: SamplingParams, settings: Settings,
                    fields: tuple[str, str]) -> SamplingParams:
    """`params` whose prompt + max_new_tokens fit the context (WCODEC_MAX_TOTAL_TOKENS, the
    model's positions): the server's default length cut to what the prompt leaves (at least one
    token), as TGI's router does; a length the request gave that does not fit is its error, and so
    is a `min_tokens` over the length (vLLM's rule; with no max_tokens, over what the context leaves:
    its EOS masked to the end of the context, which took minutes, where vLLM answers 400)."""
    inputs, new = fields
    limit = min(settings.max_total_tokens, served.max_positions)
    if params.default_length:
        params = dataclasses.replace(params, max_new_tokens=max(1, min(params.max_new_tokens, limit - len(ids))))
    if len(ids) + params.max_new_tokens > limit:
        raise ValidationFailed(f"`{inputs}` tokens + `{new}` must be <= {limit}. Given: {len(ids)} "
                               f"`{inputs}` tokens and {params.max_new_tokens} `{new}`", param=new)
    if params.min_tokens > params.max_new_tokens:
        raise ValidationFailed(f"`min_tokens` must be <= the {params.max_new_tokens} new tokens that the context "
                               f"({limit}) leaves after {len(ids)} `{inputs}` tokens. Given: {params.min_tokens}",
                               param="min_tokens")
    return params


def unicode_text(text: str, field: str) -> str:
    """`text`, where it is Unicode the tokenizer can take: JSON lets a request carry a lone UTF-16
    surrogate ("\\ud800" unpaired), which no UTF-8 text holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValidationFailed(f"`{field}` is not valid Unicode: a lone surrogate at character {e.start}",
                               param=field) from None
    return text


async def off_loop(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` on the validation thread, the event loop free meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(VALIDATION, functools.partial(fn, *args, **kwargs))


async def input_tokens(registry: ModelRegistry, model: str | None, prompt: str, truncate: int | None,
                       special: bool = True) -> list[SimpleToken]:
    """TGI's /tokenize: the tokens /generate would feed the model for `prompt` (special tokens
    added unless `special` is false, as for a chat template's text; the last `truncate` kept),
    each with the characters of `prompt` it covers."""
    name = registry.resolve(model)
    lease = registry.acquire(name)
    try:
        enc = await off_loop(lease.served.tokenizer, unicode_text(prompt, "inputs"), add_special_tokens=special,
                             return_offsets_mapping=True)
    except NotImplementedError:                  # transformers' Python tokenizers give no offsets
        raise ValidationFailed(f"model {name!r} has a Python tokenizer, which gives no character offsets",
                               param="inputs") from None
    finally:
        lease.release()
    pairs = list(zip(enc["input_ids"], enc["offset_mapping"]))
    pairs = pairs[-truncate:] if truncate else pairs
    return [SimpleToken(id=i, text=prompt[a:b], start=a, stop=b) for i, (a, b) in pairs]


async def _constrained(served: ServedModel, params: SamplingParams, grammar: tuple[str, dict | str] | None,
                       field: str, limits: constraints.CompileLimits) -> SamplingParams:
    """`params` with the index of `grammar` (('regex', pattern) or ('schema', JSON schema)), compiled
    off the event loop (a fraction of a second to minutes, by the pattern; held to `limits`); a
    grammar that does not compile within them is the request's 422, naming `field`; no compile
    slot free within `limits.seconds` is a 429, as TGI answers an overloaded model."""
    if grammar is None:
        return params
    try:
        index = await constraints.index_async(served, grammar, limits)
    except constraints.GrammarError as e:
        raise ValidationFailed(f"`{field}`: {e}", param=field) from None
    except constraints.GrammarBusy as e:
        raise QueueFull(f"`{field}`: {e}") from None
    return dataclasses.replace(params, grammar=index)


async def start(registry: ModelRegistry, settings: Settings, model: str | None, prompt: str | list[int],
                params: Params, *, stream: bool, truncate: int | None = None,
                special: bool = True, fields: tuple[str, str] = ("inputs", "max_new_tokens"),
                grammar: tuple[str, dict | str] | None = None, grammar_field: str = "grammar",
                group: RequestGroup | None = None, prompt_index: int = 0) -> Started:
    """Queue a generation on the model; the lease ends when the engine finishes the request.
    `prompt`: a text, or token ids (its text is then their decode). `fields`: the request's names
    for the prompt and the token limit, for the error messages. `grammar`: the text's constraint
    (`_constrained`), named `grammar_field` in errors. `group`: the HTTP request's sequences, this
    one of prompt `prompt_index` (engine/group.py: the metrics count the request once)."""
    name = registry.resolve(model)
    lease = registry.acquire(name)
    try:
        params = params(lease.served) if callable(params) else params
        limits = constraints.CompileLimits(settings.grammar_compile_s, settings.grammar_compile_bytes)
        try:
            params = await _constrained(lease.served, params, grammar, grammar_field, limits)
        except QueueFull:
            lease.engine.overloaded()
            raise
        ids = await off_loop(_tokenize, lease.served, prompt, params, truncate, settings, special, fields[0])
        params = _within_context(lease.served, ids, params, settings, fields)
        req = GenRequest(ids, params, stream=stream, group=group, prompt=prompt_index)
        lease.engine.submit(req)
    except BaseException:
        lease.release()
        raise
    req.add_done_callback(lease.release)
    text = prompt if isinstance(prompt, str) else lease.served.tokenizer.decode(ids, skip_special_tokens=False)
    return Started(name, lease.served, req, text)


async def start_many(registry: ModelRegistry, settings: Settings, model: str | None, prompts: list[str | list[int]],
                     params: Params, n: int, *, stream: bool, **kw) -> list[Started]:
    """One engine request per sequence: `n` per prompt, prompt after prompt (sequence i is prompt
    i // n), so they batch with each other and with every other route's (OpenAI's choices, TGI's
    best_of). With a seed, sequence j of a prompt samples with seed + j (mod 2^64), so that the n
    samples differ and repeat. More sequences than a model queues could never all be admitted: a
    422 (400 on OpenAI's routes) names `n`, where a 429 would have the client retry in vain. They
    are one request in the metrics (engine/group.py)."""
    if (total := len(prompts) * n) > settings.max_queue:
        raise ValidationFailed(f"the request asks for {total} generations ({len(prompts)} prompts x {n} each); "
                               f"this server queues at most {settings.max_queue} a model (WCODEC_MAX_QUEUE)",
                               param="n")
    started, group = [], RequestGroup(total)
    try:
        for i, prompt in enumerate(prompts):
            for j in range(n):
                started.append(await start(registry, settings, model, prompt, _nth(params, j), stream=stream,
                                           group=group, prompt_index=i, **kw))
    except BaseException:
        cancel_all(started)
        raise
    return started


def _nth(params: Params, j: int) -> Params:
    """Sequence j's parameters: with a seed, seed + j (mod 2^64)."""
    def shifted(p: SamplingParams) -> SamplingParams:
        return p if j == 0 or p.seed is None else dataclasses.replace(p, seed=(p.seed + j) % 2**64)
    return (lambda served: shifted(params(served))) if callable(params) else shifted(params)


def cancel_all(started: list[Started]) -> None:
    for s in started:
        s.request.cancel()


async def finish_all(started: list[Started], request: Request | None = None) -> list[Finished]:
    """Every generation's end. With the HTTP `request` (the routes that answer once, at the end), a
    client that hangs up first cancels them, as vLLM's and TGI's servers do: their rows and KV
    blocks go at once instead of at max_new_tokens (ClientClosed)."""
    results = asyncio.ensure_future(asyncio.gather(*(s.request.result() for s in started)))
    hung_up = asyncio.ensure_future(_hung_up(request)) if request is not None else None
    try:
        if hung_up is not None:
            await asyncio.wait({results, hung_up}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():
                raise ClientClosed(f"the client closed the request; its {len(started)} generations were cancelled")
        return list(await results)
    finally:
        cancel_all(started)
        for task in (results, hung_up):
            if task is not None and not task.done():
                task.cancel()
                task.add_done_callback(_read_outcome)


def _read_outcome(task: asyncio.Future) -> None:
    """Marks a cancelled future's outcome read: a gather cancelled midway ends with CancelledError
    as its exception (not cancelled), which asyncio logged at every client hang-up as an ERROR
    with a traceback ("exception was never retrieved")."""
    if not task.cancelled():
        task.exception()


async def _hung_up(request: Request) -> None:
    """Returns when the client disconnects: once a request's body is read, the next ASGI message
    is http.disconnect (uvicorn sends it when the socket closes, or after the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_events(started: list[Started]) -> list[TokenEvent | Finished]:
    """Every choice's first event before answering 200, so a failed prefill is a plain error."""
    try:
        return [await s.request.next() for s in started]
    except BaseException:
        cancel_all(started)
        raise


def mean_logprob(fin: Finished) -> float:
    """A sequence's mean log-probability a token: how TGI's best_of and OpenAI's pick the best
    (a sum would favour the shortest); -inf for none."""
    return sum(t.logprob for t in fin.tokens) / len(fin.tokens) if fin.tokens else float("-inf")


def sse(payload: BaseModel | dict | str) -> bytes:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n".encode()


async def first_event(started: Started) -> TokenEvent | Finished:
    """Wait for the first token before answering 200, so a failed prefill is a plain 424."""
    try:
        return await started.request.next()
    except BaseException:
        started.request.cancel()
        raise


async def events(started: Started, first: TokenEvent | Finished) -> AsyncIterator[TokenEvent | Finished]:
    """The request's events from `first` on; cancels the generation when the consumer stops."""
    item = first
    try:
        while True:
            yield item
            if isinstance(item, Finished):
                return
            item = await started.request.next()
    finally:
        started.request.cancel()
