"""Generation for the ready models, one engine per model: requests in, token events out
(continuous batching).

    worker.py    Engine: the model's worker thread, the waiting line (429 beyond WCODEC_MAX_QUEUE),
                 metrics; GenRequest: one request's events, handed to the event loop
    group.py     RequestGroup: the GenRequests of one HTTP request (n, best_of, prompt lists),
                 counted once in the per-request metrics
    batcher.py   Batcher: one decoding step after another; admits waiting rows up to the token
                 budget (WCODEC_MAX_BATCH_TOKENS), prefills them in chunks, drops finished rows
    kv.py        PaddedKV: the batch's KV cache (service/model/kvcache.py's KVCache for llama.py's
                 models, else transformers' DynamicCache), rows merged and dropped
    scheduler.py Scheduler: the same for llama.py's models over a paged KV cache allocated once
                 (blocks.py: blocks and block tables; paging.py: the cache's size); runner.py: the
                 forward of a step, decode-only steps replayed as CUDA graphs
    sampling.py  Row (one request's tokens and stop rules, its prompt's scores when asked),
                 SamplingParams, TokenEvent and Finished; logits.py: a row's token from its
                 logits, greedy / top-k / top-p / typical sampling, penalties, TGI's watermark
    grammar.py   constrained generation (TGI's grammar, OpenAI's response_format): a regex's
                 index over the vocabulary (outlines-core), a row's Constraint; json_schema.py:
                 the schemas whose regex would not hold the text (refused); index_child.py: the
                 process that builds an index, held to a time and a memory limit

Testable without HTTP: `Batcher` takes `Row`s and calls back with their tokens, synchronously."""
from .batcher import Batcher, Step
from .group import RequestGroup
from .kv import PaddedKV
from .worker import Engine, GenRequest, Limits, limits

__all__ = ["Batcher", "Engine", "GenRequest", "Limits", "PaddedKV", "RequestGroup", "Step", "limits"]
