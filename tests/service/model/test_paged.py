"""service/model/paged.py's two step kinds on the CPU: the `Fused` step (run here with the
kernels' PyTorch references in place of Triton's, cuda_ext/step_kernels.py) over weights joined
by `fuse_projections` equals the `Modules` step, prompt chunks and decode rows (a sliding window
too: the references' decode attention takes it); joining holds no
byte twice, happens once, and skips what it cannot join. The Triton kernels themselves are
tested on the GPU (tests/gpu/test_step_kernels.py)."""
from __future__ import annotations

import pytest
import torch

from cuda_ext import step_kernels
from service.engine.inputs import Chunk, Decode
from service.engine.runner import Runner
from service.model import llama, paged

REFERENCES = step_kernels.REFERENCES
CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}


def model(**extra) -> llama.LlamaForCausalLM:
    torch.manual_seed(0)
    m = llama.LlamaForCausalLM(llama.LlamaConfig.parse({**CONFIG, **extra}), "cpu").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.02 * torch.randn_like(p) if p.dim() == 1 else 0.05 * torch.randn_like(p))
    return m


@torch.inference_mode()
def steps(m: llama.LlamaForCausalLM, fused) -> list[torch.Tensor]:
    """Two prompts in chunks, then a decode step of both: every step's logits."""
    runner = Runner(m, paged.PagedCache(m.config, 8, 16, torch.bfloat16, torch.device("cpu")), 4, 4, False, fused)
    tables, out = [[0, 1, 2], [5, 3]], []
    out.append(runner.run([], [Chunk(list(range(3, 23)), 0, tables[0]), Chunk(list(range(40, 47)), 0, tables[1])]))
    out.append(runner.run([Decode(int(out[0][1].argmax()), 7, tables[1])], [Chunk(list(range(23, 30)), 20, tables[0])]))
    out.append(runner.run([Decode(9, 30, tables[0]), Decode(11, 8, tables[1])], []))
    return out


@pytest.mark.parametrize("extra", [{}, {"model_type": "qwen2"}, {"model_type": "mistral", "sliding_window": 8},
                                   {"model_type": "qwen3", "head_dim": 64}],  # q_norm, k_norm; not 128 / 4 wide
                         ids=["llama", "qwen2-bias", "mistral-window-8", "qwen3-head-dim-64"])   # 30 keys: past windows
def test_the_fused_step_over_joined_weights_equals_the_modules_step(extra) -> None:
    m = model(**extra)
    want = steps(m, None)
    before = {n: p.clone() for n, p in m.named_parameters()}
    paged.fuse_projections(m)
    attn = m.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    assert (attn.qkv_bias is not None) == (extra.get("model_type") == "qwen2")
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())       # the same weights, views now
    for got, ref in zip(steps(m, REFERENCES), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-2)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert torch.equal(torch.cat(steps(m, None)), torch.cat(want))              # the modules still compute alone


@pytest.mark.parametrize("kernels", ["references", "cpu-step"])
def test_the_fused_steps_head_norms_are_the_modules_bit_for_bit(kernels) -> None:
    """A Qwen3's q_norm and k_norm as the Fused step runs them (the kernel set's add_rms_norm over
    [N*H, D]) on q and k as views of one joined projection: the modules' RMSNorm over each head,
    bit for bit on the CPU (the C++ twin sums each row of D as ATen does)."""
    fused = REFERENCES if kernels == "references" else step_kernels.cpu_kernels(torch.device("cpu"))
    if fused is None:
        pytest.skip("the extension's CPU step ops are not built")
    m, n = model(model_type="qwen3", head_dim=64), 7
    attn, h, kv = m.model.layers[0].self_attn, 4, 2
    qkv = 3 * torch.randn(n, (h + 2 * kv) * 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, k, _ = (t.view(n, heads, 64) for t, heads in zip(qkv.split([h * 64, kv * 64, kv * 64], 1), (h, kv, kv)))
    with torch.inference_mode():
        got, want = paged.Fused(fused).head_norms(attn, q, k), paged.MODULES.head_norms(attn, q, k)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(want[0], q) and not torch.equal(want[1], k)                  # normed


def test_joining_holds_no_byte_twice_and_happens_once() -> None:
    m = model()
    storages = lambda: {p.untyped_storage().data_ptr() for p in m.parameters()} | \
        {b.untyped_storage().data_ptr() for b in m.buffers() if b is not None}
    per_layer = len(storages())
    paged.fuse_projections(m)
    joined = m.model.layers[0].mlp.gate_up_weight
    assert len(storages()) == per_layer - 2 * 3                      # 5 weights became 2 buffers, in each of 2 layers
    paged.fuse_projections(m)
    assert m.model.layers[0].mlp.gate_up_weight is joined


def test_joining_skips_parts_it_cannot_join() -> None:
    from service.model import cpu_dtype
    m = model()
    mlp = m.model.layers[1].mlp
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.float(), requires_grad=False)    # two dtypes
    m.model.layers[0].self_attn.k_proj.__class__ = cpu_dtype.Linear16                           # two classes
    m.model.layers[1].self_attn.q_proj.__class__ = cpu_dtype.MixedLinear                        # not joinable
    paged.fuse_projections(m)
    assert not hasattr(mlp, "gate_up_weight") and hasattr(m.model.layers[0].mlp, "gate_up_weight")
    assert not hasattr(m.model.layers[0].self_attn, "qkv_weight")
    assert not hasattr(m.model.layers[1].self_attn, "qkv_weight")


def test_joined_linear16_projections_change_no_bit() -> None:
    """On the CPU's linear16 (every output its own dot product) the joined projections give the
    modules' step bit for bit, so the paged engine joins them there too (paging.py)."""
    from service.model import cpu_dtype
    if not cpu_dtype.linear16_kernel(torch.bfloat16):
        pytest.skip("linear16 has no SIMD loop on this CPU (no AVX-512)")
    m = model()
    for mod in m.modules():
        if type(mod) is llama.Linear:
            mod.__class__ = cpu_dtype.Linear16
    assert cpu_dtype.joins_exactly(m)
    want = steps(m, None)
    paged.fuse_projections(m)
    assert hasattr(m.model.layers[0].self_attn, "qkv_weight")
    assert all(torch.equal(a, b) for a, b in zip(steps(m, None), want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_start_up_warm_up_runs_the_eager_step(dtype, monkeypatch) -> None:
    """build.first_kernels' toy step (paged.warm_up): a prompt chunk and a decode row through the
    joined projections, each forward once per kind."""
    calls = []
    real = paged.forward
    monkeypatch.setattr(paged, "forward", lambda model, ids, ctx, cache, fused=None:
                        calls.append((ctx.decode, len(ctx.prefills), model.model.layers[0].self_attn.qkv_weight.dtype))
                        or real(model, ids, ctx, cache, fused))
    paged.warm_up(torch.device("cpu"), dtype)
    assert calls == [(0, 1, dtype), (1, 0, dtype)]
