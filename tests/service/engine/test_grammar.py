"""Constrained generation (service/engine/grammar.py, as TGI's grammar): the bytes each token of
the demo's byte-level vocabulary stands for; SentencePiece's pieces; a regex and a JSON schema
followed by the demo's greedy tokens through the paged engine, ending at the end of text once the
text is complete; grammars that cannot be compiled are GrammarError."""
from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from test_batching import load
from test_scheduler import generate, paged
from service_helpers import DEMO

from service.engine import grammar
from service.engine.index_child import NICE
from service.engine.sampling import Row, SamplingParams
from service.model.tokenizer import Tokenizer
from service.model.token_bytes import piece_bytes

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def demo(demo_archive):
    return load(demo_archive, DEMO)


def test_token_bytes_of_a_byte_level_vocabulary(demo) -> None:
    eos, pieces = grammar.token_bytes(demo.tokenizer)
    ids = {i: b for b, group in pieces.items() for i in group}
    assert eos == demo.tokenizer.eos_token_id and eos not in ids
    assert len(ids) == len(demo.tokenizer) - len(demo.special_ids)
    for i in random.Random(0).sample(sorted(ids), 2000):
        text = demo.tokenizer.decode([i])
        if "\ufffd" not in text:                                     # a whole character or more
            assert ids[i].decode() == text, i


def test_sentencepiece_pieces() -> None:
    assert piece_bytes("\u2581Paris", False) == b" Paris"
    assert piece_bytes("<0x0A>", False) == b"\n" and piece_bytes("<0xE2>", False) == b"\xe2"
    assert piece_bytes("\u0120Paris", True) == b" Paris" and piece_bytes("\u010a", True) == b"\n"


def byte_level(added: list[str]) -> Tokenizer:
    """A small byte-level BPE tokenizer, with `added` as added special tokens that are not among
    its named special tokens (SmolLM2's <file_sep>, <repo_name>, ...)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rust.train_from_iterator(["<file> <sep> a_b"] * 10, trainer)
    rust.add_special_tokens(added)
    return Tokenizer(rust, {}, {"eos_token": "<|im_end|>", "additional_special_tokens": []}, None)


def test_added_special_tokens_stand_for_no_text() -> None:
    """decode(skip_special_tokens=True) drops an added special token: a grammar that took one for
    its characters ended with an answer that does not follow it."""
    tok = byte_level(["<file_sep>"])
    special = tok.backend_tokenizer.token_to_id("<file_sep>")
    _, pieces = grammar.token_bytes(tok)
    assert b"<file_sep>" not in pieces and special not in {i for ids in pieces.values() for i in ids}
    index = grammar.index_of(SimpleNamespace(tokenizer=tok), r"<[a-z_]+>")
    assert special not in index.get_allowed_tokens(index.get_initial_state())


def constrained(served, prompt: str, regex: str, tokens: int = 40) -> Row:
    params = SamplingParams(tokens, grammar=grammar.index_of(served, regex))
    row = Row(served.tokenizer.encode(CHAT.format(prompt)), params, served)
    generate(paged(served), [row], together=False)
    return row


def test_a_regex_is_followed_to_the_end_of_text(demo) -> None:
    row = constrained(demo, "What year did the Second World War end?", r"(19|20)[0-9]{2}")
    text = demo.tokenizer.decode(row.ids, skip_special_tokens=True)
    assert len(text) == 4 and text[:2] in ("19", "20") and text.isdigit()
    assert row.finish_reason == "eos_token" and row.ids[-1] == demo.tokenizer.eos_token_id


def test_a_json_schema_is_followed(demo) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "enum": ["France", "Spain"]}},
              "required": ["city", "country"]}
    row = constrained(demo, "Name the capital of France as JSON.", grammar.schema_regex(schema), 60)
    out = json.loads(demo.tokenizer.decode(row.ids, skip_special_tokens=True))
    assert set(out) == {"city", "country"} and out["country"] in ("France", "Spain") and len(out["city"]) <= 20
    assert row.finish_reason == "eos_token"


def test_an_index_is_compiled_once_per_model_and_pattern(demo) -> None:
    assert grammar.index_of(demo, "[0-9]+") is grammar.index_of(demo, "[0-9]+")
    assert grammar.index_of(demo, "[0-9]+") is not grammar.index_of(demo, "[a-z]+")


def test_grammars_that_do_not_compile(demo) -> None:
    with pytest.raises(grammar.GrammarError, match="schema"):
        grammar.schema_regex({"type": "nonsense"})
    with pytest.raises(grammar.GrammarError):
        grammar.index_of(demo, "(unclosed")


def test_an_index_too_costly_to_build_is_a_grammar_error_in_time() -> None:
    """Building an index can take minutes and gigabytes ({"type": "string", "maxLength": 20}: 104 s
    and 4.4 GB for the demo's vocabulary on a 2-core CPU, twice that for each character more), in
    a thread that nothing could stop: it is a child process, killed at the time limit, whose
    allocations fail beyond the memory limit; the failure is kept like an index."""
    served = SimpleNamespace(tokenizer=byte_level([]))
    slow, large = r"a{100000}", grammar.schema_regex({"type": "string", "maxLength": 20})
    started = time.monotonic()
    with pytest.raises(grammar.GrammarError, match="did not compile within 1 s"):
        grammar.index_of(served, slow, grammar.CompileLimits(seconds=1))
    assert time.monotonic() - started < 5
    with pytest.raises(grammar.GrammarError, match="did not compile within 1 s"):      # kept: not built again
        grammar.index_of(served, slow, grammar.CompileLimits(seconds=1))
    assert time.monotonic() - started < 5
    with pytest.raises(grammar.GrammarError, match=f"its limit is {1 << 28} bytes"):
        grammar.index_of(served, large, grammar.CompileLimits(seconds=60, bytes=1 << 28))


def test_a_compile_runs_at_the_lowest_cpu_priority() -> None:
    """A pattern may compile for its whole time limit: its process runs at nice 19, so that it
    takes only the CPU that serving leaves idle (at its default priority it held one of a 2-core
    CPU's two for 120 s, and other requests slowed to seconds)."""
    vocabulary = grammar._outlines().Vocabulary(*grammar.token_bytes(byte_level([])))
    child = subprocess.Popen([sys.executable, str(grammar.CHILD)], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        child.stdin.write(pickle.dumps((r"a{100000}", vocabulary, 1 << 32)))
        child.stdin.close()
        nice = lambda: int(open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[16])
        deadline = time.monotonic() + 20
        while nice() != NICE and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert child.poll() is None and nice() == NICE == 19       # still compiling, at the lowest priority
    finally:
        child.kill()
        child.wait()


def in_thread(call, *args) -> tuple[threading.Thread, list]:
    """`call(*args)` started in a thread; the list gets its result or its exception."""
    out: list = []

    def run() -> None:
        try:
            out.append(call(*args))
        except Exception as e:                                   # noqa: BLE001 - handed to the test
            out.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_request_that_finds_no_compile_slot_in_time_is_busy() -> None:
    """Both slots held by slow builds: a third request waited without bound (its HTTP request
    hung); it waits `limits.seconds`, then is GrammarBusy, which is not kept."""
    served, limits = SimpleNamespace(tokenizer=byte_level([])), grammar.CompileLimits(seconds=0.5)
    held = [grammar._compiles.acquire(timeout=0) for _ in range(grammar.COMPILES)]
    try:
        assert all(held)
        started = time.monotonic()
        thread, out = in_thread(grammar.index_of, served, "[a-c]+busy", limits)
        thread.join(5)
        assert not thread.is_alive() and 0.4 < time.monotonic() - started < 5
        assert isinstance(out[0], grammar.GrammarBusy) and "no slot freed within 0.5 s" in str(out[0])
    finally:
        for _ in range(grammar.COMPILES):
            grammar._compiles.release()
    index = grammar.index_of(served, "[a-c]+busy", limits)                    # built once a slot is free
    assert index.get_allowed_tokens(index.get_initial_state())


def test_two_requests_for_one_pattern_build_it_once(monkeypatch) -> None:
    """A request for a pattern another is building waits for that build (it built it again, in
    a second process, and took a second slot)."""
    served, runs, run = SimpleNamespace(tokenizer=byte_level([])), [], subprocess.run

    def slow_run(*args, **kw):
        runs.append(args)
        time.sleep(0.5)
        return run(*args, **kw)
    monkeypatch.setattr(grammar.subprocess, "run", slow_run)
    first, out1 = in_thread(grammar.index_of, served, "[d-f]+once")
    time.sleep(0.1)
    second, out2 = in_thread(grammar.index_of, served, "[d-f]+once")
    first.join(30), second.join(30)
    assert len(runs) == 1 and out1[0] is out2[0]
    assert out1[0].get_allowed_tokens(out1[0].get_initial_state())
