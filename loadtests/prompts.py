"""The load scenarios' prompts (loadtests/locustfile.py), without locust: bench/prefix_cache_gpu.py
sends one too, from a process that must not take gevent's patches of the standard library."""
from __future__ import annotations

import itertools
import os

SHARED_WORDS = int(os.environ.get("WCODEC_LOAD_SHARED", "600"))
TOPICS = ["the sea", "volcanoes", "a lighthouse keeper", "bread baking", "the moon", "honeybees", "a chess game",
          "autumn leaves", "a train journey", "glaciers", "an old library", "city traffic", "desert nights",
          "a violin maker", "rainforests", "a snowstorm"]
TASKS = ["Write a short story about {}.", "Describe {} in detail.", "Explain to a child how {} works.",
         "Write a poem about {}.", "Give me a long list of facts about {}."]
SERIAL = itertools.count()


def question() -> str:
    """A different request every call: a task about a topic, numbered."""
    n = next(SERIAL)
    return TASKS[n % len(TASKS)].format(TOPICS[(n // len(TASKS)) % len(TOPICS)]) + f" (request {n})"


def prompt() -> str:
    return f"<|im_start|>user\n{question()}<|im_end|>\n<|im_start|>assistant\n"


def shared_prompt() -> str:
    """A system prompt of SHARED_WORDS words, the same for every request, then `prompt()`."""
    words = " ".join(f"{TOPICS[i % len(TOPICS)].split()[-1]}" for i in range(SHARED_WORDS))
    return f"<|im_start|>system\nYou answer questions about these notes: {words}<|im_end|>\n{prompt()}"
