"""A model's own sampling defaults: the keys its generation_config.json sets among those vLLM's
`--generation-config auto` honours (ModelConfig.get_diff_sampling_param: temperature, top_p,
top_k, min_p, repetition_penalty, max_new_tokens). OpenAI's routes fill a field the request
leaves out with them (openai_api.sampling).

The file's JSON is read as it is, not through transformers' GenerationConfig: its attributes
hold the class's defaults for the keys a file does not set (transformers 4's top_k 50,
temperature 1.0), which would pass for the model's own. A value outside its range (the bounds
a request's field has) or not a number is left out, and logged."""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

log = logging.getLogger(__name__)

# key -> whether a value (a number, not a bool) is one the engine can take
RANGES: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v == int(v) and v >= -1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
    "max_new_tokens": lambda v: v == int(v) and v >= 1,
}
INTEGERS = ("top_k", "max_new_tokens")


def sampling_defaults(name: str, blob: bytes | None) -> dict[str, float]:
    """The defaults that `blob` (the archive's generation_config.json; None: none) sets, each
    checked; {} where there is no file or it is not a JSON object."""
    try:
        config = json.loads(blob) if blob else {}
    except ValueError:
        config = None
    if not isinstance(config, dict):
        log.warning("model %r: generation_config.json is not a JSON object; no sampling defaults", name)
        return {}
    defaults: dict[str, float] = {}
    for key, valid in RANGES.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not valid(value):
            log.warning("model %r: generation_config.json's %s %r is left out (not a value a request may "
                        "give)", name, key, value)
            continue
        defaults[key] = int(value) if key in INTEGERS else float(value)
    return defaults
