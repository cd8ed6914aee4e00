"""The decode step's CPU ops (cuda_ext/csrc/step_cpu.cpp) against their references, bit for bit:
add + RMSNorm (every dtype, row widths with and without a vector or ILP tail, widths long enough
for ATen's cascade levels), rotary + cache write from a joined projection's views, and paged
decode attention against the paged engine's gathered SDPA (one row on following blocks, on
scattered blocks, rows of different lengths, grouped heads); opcheck; and the paged forward with
them equals the modules' forward, logits bit for bit, prompt chunks and decode rows."""
from __future__ import annotations

import random

import pytest
import torch

from cuda_ext import ops, step_kernels
from service.model import llama, paged

KERNELS = step_kernels.cpu_kernels(torch.device("cpu"))
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no step ops in the extension, or a torch whose "
                                                        "float sums add_rms_norm does not follow")
LANES = step_kernels.norm_lanes() if KERNELS is not None else None
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def spread(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over several binades (sums that round), as a residual stream has them."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 64, 100, 960, 1000, 4096, 8200, 65536 + 48])
def test_add_rms_norm_is_the_reference(dtype, width) -> None:
    rows = 3 if width > 5000 else 70
    x, h = spread(rows, width, seed=width, dtype=dtype), spread(rows, width, seed=width + 1, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(2))).to(dtype)
    for hh in (h, None):
        total, normed = ops.add_rms_norm(x, hh, weight, 1e-5, LANES)
        ref_total, ref_normed = step_kernels.add_rms_norm_reference(x, hh, weight, 1e-5)
        assert torch.equal(total, ref_total) and torch.equal(normed, ref_normed)
        one_total, one = ops.add_rms_norm(x[:1], None if hh is None else hh[:1], weight, 1e-6, LANES)
        assert torch.equal(one, step_kernels.add_rms_norm_reference(x[:1], None if hh is None else hh[:1],
                                                                    weight, 1e-6)[1])


def test_add_rms_norm_refuses_mixed_dtypes_and_the_kernel_set_falls_back() -> None:
    x, w = torch.randn(2, 64).bfloat16(), torch.ones(64)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.add_rms_norm(x, None, w, 1e-5, LANES)
    assert torch.equal(KERNELS.add_rms_norm(x, None, w, 1e-5)[1], step_kernels.add_rms_norm_reference(x, None, w, 1e-5)[1])


def qkv(n: int, heads: int, kv: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as paged.attention has them: views of one joined projection [N, (H + 2 KV) * D]."""
    joined = spread(n, (heads + 2 * kv) * d, seed=seed, dtype=dtype)
    return tuple(t.view(n, -1, d) for t in joined.split([heads * d, kv * d, kv * d], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_is_the_reference(dtype) -> None:
    n, heads, kv, d, slots_total = 5, 9, 3, 64, 48
    q, k, v = qkv(n, heads, kv, d, dtype, 3)
    config = llama.LlamaConfig.parse({"model_type": "llama", "vocab_size": 8, "hidden_size": heads * d,
                                      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": heads,
                                      "num_key_value_heads": kv})
    cos, sin = llama.Rotary(config)(q, torch.tensor([0, 7, 8, 30, 1000]))
    sin = llama._signed_sin(sin)
    slots = torch.tensor([3, 17, 18, 40, 0])
    caches = [spread(slots_total, kv, d, seed=s, dtype=dtype) for s in (4, 5)]
    mine, ref = [c.clone() for c in caches], [c.clone() for c in caches]
    out = ops.rope_store(q, k, v, cos, sin, *mine, slots)
    expect = step_kernels.rope_store_reference(q, k, v, cos, sin, *ref, slots)
    assert torch.equal(out, expect) and torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_store(q, k, v, cos, sin, *mine, slots + slots_total)


def context(tables: list[list[int]], lengths: list[int]) -> paged.Context:
    """A decode-only context as the runner's eager step makes it (keys: the longest row)."""
    lens = torch.tensor(lengths)
    zeros = torch.zeros(len(lengths), dtype=torch.long)
    return paged.Context(zeros, zeros, len(lengths), torch.tensor(tables), lens, keys=max(lengths))


@pytest.mark.parametrize("tables, lengths", [([[2, 3, 4, 5]], [50]), ([[2, 3, 4, 5]], [64]), ([[5, 0, 3, 1]], [49]),
                                             ([[0, 1, 2, 3]], [1]), ([[0, 2, 4, 6], [1, 3, 5, 7], [6, 6, 6, 6]],
                                                                     [40, 64, 3])])
@pytest.mark.parametrize("heads, kv", [(9, 3), (4, 4)])
def test_decode_attention_is_the_paged_engines(tables, lengths, heads, kv) -> None:
    bs, d = 16, 64
    k_cache, v_cache = (spread(8 * bs, kv, d, seed=s, dtype=torch.bfloat16) for s in (6, 7))
    q = spread(len(lengths), heads, d, seed=8, dtype=torch.bfloat16)
    ctx = context(tables, lengths)
    paged._masks(ctx, bs, q.device, True)
    theirs = paged.Modules.decode_attention(q, k_cache, v_cache, ctx, bs, d ** -0.5)
    ours = ops.decode_attention(q, k_cache, v_cache, ctx.tables, ctx.lengths, bs, d ** -0.5)
    assert torch.equal(ours, theirs)


def test_decode_attention_refuses_blocks_outside_the_cache() -> None:
    k_cache = torch.zeros(32, 1, 8).bfloat16()
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.decode_attention(torch.zeros(1, 2, 8).bfloat16(), k_cache, k_cache, torch.tensor([[2]]),
                             torch.tensor([3]), 16, 1.0)
    with pytest.raises(RuntimeError, match="outside its table"):
        ops.decode_attention(torch.zeros(1, 2, 8).bfloat16(), k_cache, k_cache, torch.tensor([[1]]),
                             torch.tensor([17]), 16, 1.0)


def test_opcheck() -> None:
    x, h, w = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.ones(64).bfloat16()
    torch.library.opcheck(torch.ops.wcodec.add_rms_norm.default, (x, h, w, 1e-5, LANES))
    torch.library.opcheck(torch.ops.wcodec.add_rms_norm.default, (x, None, w, 1e-5, LANES))
    q, k, v = qkv(2, 4, 2, 16, torch.bfloat16, 9)
    cos, sin = torch.randn(2, 16).bfloat16(), torch.randn(2, 16).bfloat16()
    caches = (torch.zeros(32, 2, 16).bfloat16(), torch.zeros(32, 2, 16).bfloat16())
    torch.library.opcheck(torch.ops.wcodec.rope_store.default, (q, k, v, cos, sin, *caches, torch.tensor([1, 20])))
    torch.library.opcheck(torch.ops.wcodec.decode_attention.default,
                          (q.contiguous(), *caches, torch.tensor([[0, 1], [1, 0]]), torch.tensor([20, 3]), 16, 0.25))


@torch.inference_mode()
def test_paged_forward_with_the_cpu_ops_equals_the_modules() -> None:
    """A toy llama (grouped heads) through paged.forward: two prompts chunked, then decode steps of
    both rows; the logits of the CPU ops' step equal the modules' step's bit for bit, its decode
    steps' written into the rows of a given buffer (`out`, as the runner's graphs do)."""
    config = llama.LlamaConfig.parse({"model_type": "llama", "vocab_size": 96, "hidden_size": 128,
                                      "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "rms_norm_eps": 1e-5})
    model = llama.LlamaForCausalLM(config, device="cpu")
    g = torch.Generator().manual_seed(10)
    for p in model.parameters():
        p.data = ((1.0 if p.dim() == 1 else 0.0) + 0.05 * torch.randn(p.shape, generator=g)).bfloat16()
    paged.fuse_projections(model)
    rng = random.Random(11)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (21, 9)]
    tables = [[0, 1, 2, 3], [5, 4, 7, 6]]
    logits = {}
    for name, kernels in (("modules", None), ("cpu", KERNELS)):
        cache = paged.PagedCache(config, 8, 16, torch.bfloat16, torch.device("cpu"))
        steps = []
        for ids, table in zip(prompts, tables):
            for start, end in ((0, len(ids) // 2), (len(ids) // 2, len(ids))):
                slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(end)])
                ctx = paged.Context(torch.arange(start, end), slots[start:], 0, None, None,
                                    [paged.Prefill(0, end - start, start, slots)], torch.tensor([end - start - 1]))
                steps.append(paged.forward(model, torch.tensor(ids[start:end]), ctx, cache, kernels))
        tokens, positions = [int(s.argmax()) for s in steps[1::2]], [len(p) for p in prompts]
        for _ in range(12):
            pos = torch.tensor(positions)
            slots = torch.tensor([tables[r][p // 16] * 16 + p % 16 for r, p in enumerate(positions)])
            ctx = paged.Context(pos, slots, 2, torch.tensor(tables), pos + 1, keys=int(pos.max()) + 1)
            shared = torch.empty(4, 96) if kernels else None                 # the runner's graphs' logits buffer
            out = paged.forward(model, torch.tensor(tokens), ctx, cache, kernels, None if shared is None else shared[:2])
            assert shared is None or out.data_ptr() == shared.data_ptr()
            steps.append(out.clone())
            tokens, positions = out.argmax(-1).tolist(), [p + 1 for p in positions]
        logits[name] = torch.cat(steps)
    assert torch.equal(logits["cpu"], logits["modules"])
