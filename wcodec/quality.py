"""The quality report of a lossy compress (`wcodec compress --codec int8`): per-tensor SNR and
largest absolute error (measured by the encoder against the source values), and a causal LM's
perplexity on a fixed text, with the source's weights and with the archive's decoded ones."""
from __future__ import annotations

import math
import statistics

import torch

from codec.sources import open_source
from service.load.pipeline import load_archive

MAX_TOKENS = 512


def perplexity(files: dict[str, bytes], tensors: dict[str, torch.Tensor], text: str) -> float:
    """exp(mean next-token loss) of the model that `files` (config, tokenizer) and `tensors` make."""
    from service.model import build
    prepared = build.prepare("quality", files)
    model = build.assemble(prepared.config, tensors, torch.device("cpu"), prepared.model)
    ids = torch.tensor([list(prepared.tokenizer(text)["input_ids"])[:MAX_TOKENS]])     # [1, S]
    with torch.inference_mode():                       # the service's model: logits only, no labels
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()          # [S - 1, V]
        return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))


def source_perplexity(src, text: str, gguf_dtype: torch.dtype) -> float:
    """Perplexity with the source checkpoint's weights (before the compress: a source that makes no
    causal LM fails here, before any archive is written)."""
    with open_source(src, gguf_dtype=gguf_dtype) as source:
        return perplexity(source.files, {i.name: source.load(i.name) for i in source.tensors()}, text)


def archive_perplexity(dst, text: str) -> float:
    """Perplexity with the archive's decoded weights."""
    model = load_archive(dst, "cpu")
    return perplexity(model.files, model.state_dict, text)


def format_report(quality: dict[str, dict], ppl: tuple[float, float] | None) -> str:
    rows = [("tensor", "SNR dB", "max abs err")]
    rows += [(name, f"{q['snr_db']:.2f}", f"{q['max_abs_err']:.3g}") for name, q in quality.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    if quality:
        snr = [q["snr_db"] for q in quality.values()]
        lines.append(f"int8: {len(snr)} tensors, SNR min {min(snr):.2f} dB, median {statistics.median(snr):.2f} dB, "
                     f"max abs err {max(q['max_abs_err'] for q in quality.values()):.3g}")
    if ppl is not None:
        lines.append(f"perplexity: before {ppl[0]:.4f}, after {ppl[1]:.4f} (delta {ppl[1] - ppl[0]:+.4f})")
    return "\n".join(lines)
