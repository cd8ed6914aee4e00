"""Constrained generation: TGI's `grammar` (a JSON schema or a regex) and OpenAI's `response_format`
(json_object, json_schema), as TGI does it, through outlines-core:
a JSON schema becomes a regex (`build_regex_from_schema`); the regex and the model's vocabulary
become an index of the tokens that each state of the regex's automaton allows. A row keeps its
state, takes only allowed tokens (the end of text only in a final state) and advances with each.

    token_bytes(tokenizer)   the bytes each non-special token stands for (model/token_bytes.py: GPT-2's
                             byte-level table, or SentencePiece's ▁ and <0xNN> pieces); other tokenizers:
                             GrammarError
    index_of(served, regex)  the index, kept per model and pattern, built in a child process held
                             to a time and memory limit (index_child.py; a small schema's takes
                             ~0.5 s for the demo's 49k tokens on a 2-core CPU, {"type": "object"}
                             0.4 s, a string of maxLength 20 104 s), COMPILES at once: a request
                             that finds no slot free within its limit is GrammarBusy (429), one
                             for a pattern being built waits for that build
    index_async(...)         the same off the event loop, on threads of its own, the wait for a slot
                             counted from the call
    Constraint               a row's place in it: `mask(logits)` and `advance(token)`
"""
from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.token_bytes import BYTE_LEVEL, decoder_steps, piece_bytes, vocabulary_kind
from .index_child import DOES_NOT_COMPILE
from .json_schema import TOO_DEEP, prepared, refusal
from .regex_syntax import ascii_classes

KEPT = 32                                       # compiled indexes kept per process (by model and pattern)
COMPILES = 2                                    # indexes built at once (a process each, up to its bytes)
WAITING = 32                                    # threads of index_async (building or waiting for a slot)
CHILD = Path(__file__).with_name("index_child.py")


class GrammarError(ValueError):
    """A grammar this server cannot compile: its message says why (the caller answers 422)."""


class GrammarBusy(RuntimeError):
    """Every compile slot stayed busy for as long as the request may wait: the server is
    overloaded, not the grammar wrong (the caller answers 429 with Retry-After, TGI's
    "Model is overloaded"; nothing is kept, so a later request builds it)."""


def token_bytes(tokenizer) -> tuple[int, dict[bytes, list[int]]]:
    """(end-of-text id, the bytes of every other token -> its ids) of a fast tokenizer. Special
    tokens, added ones marked special included, are left out: the answer's text drops them
    (decode(skip_special_tokens=True)), so a grammar that let one stand for its characters let
    SmolLM2's <file_sep> satisfy `<[a-z_]+>` in an answer that then had none of them."""
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if rust is None or tokenizer.eos_token_id is None:
        raise GrammarError("grammar needs a fast tokenizer with an end-of-text token")
    kind = vocabulary_kind(rust)
    if kind is None:
        raise GrammarError(f"grammar needs a byte-level or SentencePiece tokenizer, not {sorted(decoder_steps(rust))}")
    byte_level = kind == BYTE_LEVEL
    added = rust.get_added_tokens_decoder()
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}   # text drops them
    pieces: dict[bytes, list[int]] = {}
    try:
        for piece, i in rust.get_vocab(with_added_tokens=True).items():
            if i not in special:                           # an added token is its text, not pieces
                pieces.setdefault(piece.encode() if i in added else piece_bytes(piece, byte_level), []).append(i)
    except KeyError as e:                                  # a character outside the byte-level alphabet
        raise GrammarError(f"token {e} of the vocabulary is not a byte-level piece") from None
    return tokenizer.eos_token_id, pieces


def _outlines():
    try:
        import outlines_core
        import outlines_core.json_schema
    except ImportError:                                    # a dependency of pyproject.toml: a broken install
        raise GrammarError("grammar needs the outlines-core package, which is not installed") from None
    return outlines_core


def schema_regex(schema: dict | str, limits: CompileLimits | None = None, deadline: float | None = None) -> str:
    """A JSON schema's regex (outlines-core's, as TGI's, of the schema `prepared`: its patterns
    anchored, its free-form values' nesting bounded; `\\d`, `\\w` ASCII as JSON Schema's:
    json_schema.py, regex_syntax.py), built in a child process held to `limits` (`_in_child`);
    GrammarError for a schema whose regex would not hold the text to it (json_schema.py)."""
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
    except ValueError:                                     # not JSON: outlines-core says so below
        parsed = None
    except RecursionError:                                 # nested past what Python's json reads
        raise GrammarError(f"unsupported JSON schema: {TOO_DEEP}") from None
    if why := refusal(parsed):
        raise GrammarError(f"unsupported JSON schema: {why}")
    try:
        text = schema if parsed is None else json.dumps(prepared(parsed))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"unsupported JSON schema: {e}") from None
    limits = limits or CompileLimits()
    return _regex_of(text, limits, deadline or time.monotonic() + limits.seconds)


def _regex_of(text: str, limits: CompileLimits, deadline: float) -> str:
    """The regex of a schema's text, kept for the last KEPT schemas (a refusal is not kept)."""
    if (regex := _regexes.get((text, limits))) is not None:
        return regex
    regex = ascii_classes(_in_child((text, None, limits.bytes), limits, deadline, "unsupported JSON schema"))
    _regexes.put((text, limits), None, regex)
    return regex


class _Kept:
    """The last `size` values by key, each kept with the tokenizer it was made for (held, so that
    its id, the key's first part, cannot be reused while the entry lives)."""

    def __init__(self, size: int):
        self.size, self.items, self.lock = size, OrderedDict(), threading.Lock()

    def get(self, key: tuple):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key][1]
        return None

    def put(self, key: tuple, tokenizer, value) -> None:
        with self.lock:
            self.items[key] = (tokenizer, value)
            while len(self.items) > self.size:
                self.items.popitem(last=False)


_indexes, _vocabularies = _Kept(KEPT), _Kept(4)
_compiles = threading.BoundedSemaphore(COMPILES)
_building: dict[tuple, Future] = {}                 # (tokenizer id, pattern, limits) -> the build under way
_building_lock = threading.Lock()
_regexes = _Kept(KEPT)                              # (schema text, limits) -> its regex (_regex_of)
_threads = ThreadPoolExecutor(WAITING, thread_name_prefix="grammar")   # not the loop's: loads use that


@dataclass(frozen=True)
class CompileLimits:
    """What building one index may take (Settings.grammar_compile_s and grammar_compile_bytes).
    A request waits for a compile slot as long as a build may last, `seconds`."""
    seconds: float = 120.0
    bytes: int = 8 << 30


async def index_async(served, grammar: tuple[str, dict | str], limits: CompileLimits = CompileLimits()):
    """The index of `grammar` (('regex', pattern) or ('schema', JSON schema)), made off the event
    loop on threads of its own (requests waiting for a slot hold none of the loop's executor,
    which loads models): the wait for a slot counts from this call, time queued for a thread
    included."""
    deadline = time.monotonic() + limits.seconds
    return await asyncio.get_running_loop().run_in_executor(_threads, _index_of_grammar, served, grammar,
                                                            limits, deadline)


def _index_of_grammar(served, grammar: tuple[str, dict | str], limits: CompileLimits, deadline: float):
    kind, value = grammar
    if kind == "regex" and not isinstance(value, str):
        raise GrammarError("a regex is a string")
    return index_of(served, value if kind == "regex" else schema_regex(value, limits, deadline), limits, deadline)


def index_of(served, regex: str, limits: CompileLimits = CompileLimits(), deadline: float | None = None):
    """The index of `regex` over the model's vocabulary (kept: the last KEPT model-and-pattern
    pairs, and a pattern that failed, under these limits, as its error), built in a child process
    held to `limits`. A request for a pattern being built under the same limits waits for that
    build. GrammarBusy when no slot frees by `deadline` (time.monotonic(); default `limits.seconds`
    from now)."""
    tok = served.tokenizer
    key = (id(tok), regex, limits)
    with _building_lock:
        if (index := _kept(tok, regex, limits)) is not None:
            return index
        build = _building.get(key)
        if leads := build is None:
            build = _building[key] = Future()
    if not leads:
        return _follow(build, limits)
    try:
        build.set_result(_build(tok, regex, limits, deadline or time.monotonic() + limits.seconds))
    except BaseException as e:                         # the followers get it too
        build.set_exception(e)
    finally:
        with _building_lock:
            del _building[key]
    return build.result()


def _follow(build: Future, limits: CompileLimits):
    """The result of another request's build of the same pattern: it waits at most `limits.seconds`
    for a slot and its child runs at most as long (a minute more for the index's transfer)."""
    try:
        return build.result(timeout=2 * limits.seconds + 60)
    except TimeoutError:
        raise GrammarBusy(f"the same pattern, being compiled for another request, was not ready within "
                          f"{2 * limits.seconds + 60:g} s; try again later") from None


def _kept(tok, regex: str, limits: CompileLimits):
    """The kept index of `regex` (raises its kept failure under `limits`), or None."""
    if (index := _indexes.get((id(tok), regex))) is not None:
        return index
    if (failed := _indexes.get((id(tok), regex, limits))) is not None:
        raise failed
    return None


def _build(tok, regex: str, limits: CompileLimits, deadline: float):
    """Build and keep the index of `regex` (a GrammarError is kept too; GrammarBusy is not)."""
    if (vocabulary := _vocabularies.get((id(tok),))) is None:
        vocabulary = _outlines().Vocabulary(*token_bytes(tok))
        _vocabularies.put((id(tok),), tok, vocabulary)
    try:
        index = _compile(regex, vocabulary, limits, deadline)
    except GrammarError as e:
        _indexes.put((id(tok), regex, limits), tok, e)
        raise
    _indexes.put((id(tok), regex), tok, index)
    return index


def _compile(regex: str, vocabulary, limits: CompileLimits, deadline: float):
    """outlines-core's Index, built by index_child.py. Its cost grows steeply with some patterns
    ({"type": "string", "maxLength": 20}: 104 s and 4.4 GB on a 2-core CPU, about twice that for
    each character more), and a thread can be neither stopped nor held to a memory budget."""
    return _in_child((regex, vocabulary, limits.bytes), limits, deadline,
                     "the pattern does not compile over the model's vocabulary")


def _in_child(job: tuple, limits: CompileLimits, deadline: float, refused: str):
    """index_child.py's answer to `job`: a process killed at `limits.seconds` and failing an
    allocation beyond `limits.bytes`, once one of COMPILES slots frees (GrammarBusy if none does
    by `deadline`); GrammarError, its words after `refused`, for what outlines-core refuses."""
    payload = pickle.dumps(job)
    if not _compiles.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise GrammarBusy(f"{COMPILES} grammars are being compiled and no slot freed within "
                          f"{limits.seconds:g} s; try again later")
    try:
        try:
            done = subprocess.run([sys.executable, str(CHILD)], input=payload, capture_output=True,
                                  timeout=limits.seconds, check=False)
        except subprocess.TimeoutExpired:
            raise GrammarError(f"the pattern did not compile within {limits.seconds:g} s") from None
    finally:
        _compiles.release()
    error = done.stderr.decode(errors="replace").strip()
    if done.returncode == DOES_NOT_COMPILE:
        raise GrammarError(f"{refused}: {error}")
    if done.returncode != 0:                           # an allocation beyond the limit aborts (Rust) or raises
        raise GrammarError(f"building the pattern's index failed (exit status {done.returncode}; its limit is "
                           f"{limits.bytes} bytes): {error[-200:]}")
    return pickle.loads(done.stdout)


class Constraint:
    """A row's state in a compiled index."""

    def __init__(self, index):
        self.index = index
        self.state = index.get_initial_state()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with -inf wherever the state allows no token."""
        allowed = torch.tensor(self.index.get_allowed_tokens(self.state), dtype=torch.long, device=logits.device)
        return torch.full_like(logits, float("-inf")).index_copy(0, allowed, logits[allowed])

    def advance(self, token: int) -> None:
        """Past `token` (the end of text has no next state: the row ends there)."""
        following = self.index.get_next_state(self.state, token)
        if following is not None:
            self.state = following
