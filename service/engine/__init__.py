"""Generation for the ready models, one engine per model: continuous batching.

    worker.py    Engine: the model's worker thread, the waiting line (429 beyond WCODEC_MAX_QUEUE),
                 metrics; GenRequest: one request's events, handed to the event loop
    batcher.py   Batcher: one decoding step after another; admits waiting rows up to the token
                 budget (WCODEC_MAX_BATCH_TOKENS), prefills them in chunks, drops finished rows
    kv.py        PaddedKV: the batch's KV cache (transformers' DynamicCache), rows merged and dropped
    compute.py   the dtype a model computes in on the CPU (float32 where the CPU lacks bf16)

Testable without HTTP: `Batcher` takes `Row`s and calls back with their tokens, synchronously."""
from . import compute
from .batcher import Batcher, Step
from .kv import PaddedKV
from .worker import Engine, GenRequest, Limits

__all__ = ["compute", "Batcher", "Engine", "GenRequest", "Limits", "PaddedKV", "Step"]
