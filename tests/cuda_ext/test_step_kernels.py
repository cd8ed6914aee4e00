"""The decode step kernels' references (cuda_ext/step_kernels.py), the oracle of the Triton
kernels' GPU tests (tests/gpu/test_step_kernels.py), against the model's own maths on the CPU:
add + RMSNorm equals llama.RMSNorm after the residual add bit for bit; the per-row float32
attention equals the paged engine's gathered SDPA (paged.Modules) within bf16 rounding, for
grouped KV heads, one key and keys across blocks. And no kernel is picked off CUDA."""
from __future__ import annotations

import torch

from cuda_ext import step_kernels
from service.model import llama, paged


def test_add_rms_norm_reference_is_the_models_norm() -> None:
    torch.manual_seed(1)
    x, h = torch.randn(6, 576).bfloat16(), torch.randn(6, 576).bfloat16()
    norm = llama.RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(576))
    norm = norm.bfloat16()
    total, normed = step_kernels.add_rms_norm_reference(x, h, norm.weight, norm.eps)
    assert torch.equal(total, x + h) and torch.equal(normed, norm(x + h))


def test_decode_attention_reference_is_the_paged_engines() -> None:
    torch.manual_seed(2)
    bs, lengths, heads, kv, d = 16, [40, 17, 1], 8, 2, 64
    tables = torch.tensor([[0, 2, 3], [1, 3, 0], [2, 2, 2]])
    k_cache, v_cache = torch.randn(4 * bs, kv, d).bfloat16(), torch.randn(4 * bs, kv, d).bfloat16()
    q = torch.randn(3, heads, d).bfloat16()
    lens = torch.tensor(lengths)
    ctx = paged.Context(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), 3, tables, lens)
    paged._masks(ctx, bs, q.device, True)
    theirs = paged.Modules.decode_attention(q, k_cache, v_cache, ctx, bs, d ** -0.5)
    ours = step_kernels.decode_attention_reference(q, k_cache, v_cache, tables, lens, bs, d ** -0.5)
    torch.testing.assert_close(ours, theirs, rtol=1.6e-2, atol=2e-3)


def test_no_triton_kernels_off_cuda(monkeypatch) -> None:
    assert step_kernels.triton_kernels(torch.device("cpu")) is None
    assert step_kernels.warm_up(torch.device("cpu"), torch.bfloat16, 64, 96, 4, 2, 16, 16) is False
    monkeypatch.setenv("WCODEC_TRITON", "0")
    assert step_kernels.triton_kernels(torch.device("cuda")) is None
