"""How big a model's paged KV cache is, and the scheduler that serves from it (scheduler.py).

The cache is allocated once, when the engine starts: `kv_cache_bytes` if set; else on CUDA
`kv_cache_fraction` of the device memory free after the weights, on the CPU CPU_BYTES. Never more
than `max_rows` rows of `max_total_tokens` need, never less than one such row.

    tokens = clamp(budget // token_bytes, max_total_tokens, max_rows * max_total_tokens)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cuda_ext import step_kernels

from ..model import cpu_dtype, device_wide, fixed, paged
from ..model.build import ServedModel
from .blocks import BlockManager
from .runner import Runner
from .sampling import Row, TokenEvent
from .scheduler import Scheduler

CPU_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheSettings:
    block_size: int = 16              # WCODEC_KV_BLOCK_SIZE: tokens a block
    nbytes: int | None = None         # WCODEC_KV_CACHE_BYTES
    fraction: float = 0.5             # WCODEC_KV_CACHE_FRACTION: of the free device memory (CUDA)
    max_total_tokens: int = 2048      # WCODEC_MAX_TOTAL_TOKENS: the largest request
    cuda_graphs: bool = True          # WCODEC_CUDA_GRAPHS
    prefill_wait_s: float = 0.0       # WCODEC_PREFILL_WAIT_MS / 1e3
    prompt_graph_rows: int | None = None   # WCODEC_PROMPT_GRAPH_ROWS (None: the step's token budget)
    prefix_caching: bool = True       # WCODEC_PREFIX_CACHING


def cache_tokens(served: ServedModel, max_rows: int, s: CacheSettings) -> int:
    """Tokens of the model's cache, rounded down to whole blocks (above)."""
    per = paged.PagedCache.token_bytes(served.model.config, cache_dtype(served))
    if s.nbytes is not None:
        budget = s.nbytes
    elif served.device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(served.device)[0] * s.fraction)
    else:
        budget = CPU_BYTES
    largest = min(s.max_total_tokens, served.max_positions)
    tokens = max(min(budget // per, max_rows * largest), largest)
    return -(-tokens // s.block_size) * s.block_size


def cache_dtype(served: ServedModel) -> torch.dtype:
    """The dtype of the keys and values: the activations' (the embeddings', on every path)."""
    return served.dtype


def scheduler(served: ServedModel, max_rows: int, max_tokens: int, s: CacheSettings,
              on_token: Callable[[Row, TokenEvent], None], on_finish: Callable[[Row], None]) -> Scheduler:
    """A paged scheduler for `served` (a llama.py model), its cache allocated now."""
    tokens = cache_tokens(served, max_rows, s)
    blocks = BlockManager(tokens // s.block_size, s.block_size, s.prefix_caching)
    cache = paged.PagedCache(served.model.config, blocks.blocks, s.block_size, cache_dtype(served), served.device)
    plain = served.schedule is None
    steps = plain or served.schedule.linears_only    # compressed mode: its hooks captured in the graphs too
    fused = step_kernels.triton_kernels(served.device) if steps else None
    runner = Runner(served.model, cache, max_rows, blocks.blocks_for(min(s.max_total_tokens, served.max_positions)),
                    s.cuda_graphs and steps, step_kernels.cpu_kernels(served.device) if steps else None,
                    prompt_rows=max_tokens if s.prompt_graph_rows is None else min(max_tokens, s.prompt_graph_rows))
    if plain and (fused is not None or cpu_dtype.joins_exactly(served.model)):
        paged.fuse_projections(served.model)         # CUDA: faster; the CPU's linear16: also exact
    if fused is not None:                            # Triton's step once compiled (runner.py), the modules till then
        c = served.model.config
        permuted = fixed.fused_on_cuda(served.model)               # x written in the fused kernels' layouts
        def warm() -> bool:                          # it ends with a device-wide sync: never beside a capture
            with device_wide.LOCK:
                return step_kernels.warm_up(served.device, cache_dtype(served), c.hidden_size, c.intermediate_size,
                                            c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                            s.block_size, permuted, c.qk_norm)
        runner.warm_later(fused, warm)
    return Scheduler(runner, blocks, max_rows=max_rows, max_tokens=max_tokens, on_token=on_token,
                     on_finish=on_finish, prefill_wait_s=s.prefill_wait_s)
