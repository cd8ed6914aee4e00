"""The decode step's Triton kernels (cuda_ext/step_triton.py) against their PyTorch references
(cuda_ext/step_kernels.py) on the GPU: rotary + cache write and SiLU * up bit for bit; the
residual sum exact and RMSNorm within one bf16 place (a float32 mean summed in another order);
paged decode attention within bf16 rounding of a float32 softmax; fixed and fuzzed shapes (MHA
and grouped KV heads, one key, keys across blocks and chunks, rows of other lengths), the same
output for a row alone as in any batch, and GQA's grouped kernel within a place of the per-head
one; Qwen3's q_norm and k_norm as the Fused step runs them (add + RMSNorm over rows of head_dim)
against the modules' RMSNorm; then a whole paged
forward of a Llama (and a Qwen3) with both step kinds, a CUDA-graph replay of the Triton step, and short
prompts' steps replaying the graphs of their rows."""
from __future__ import annotations

import pytest
import torch

from cuda_ext import step_kernels as ref

pytestmark = pytest.mark.triton                          # needs triton, not the extension (conftest.py)
triton_ops = ref.triton_kernels(torch.device("cuda"))
if triton_ops is None:
    pytest.skip("triton is not importable here", allow_module_level=True)
BF16 = torch.bfloat16


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last bf16 place."""
    spacing = torch.finfo(BF16).eps * b.float().abs().clamp_min(torch.finfo(BF16).tiny)
    return (a.float() - b.float()).abs() / spacing


@pytest.mark.parametrize("n,e", [(1, 4096), (7, 576), (64, 4096), (3, 5000)])
@pytest.mark.parametrize("with_h", [False, True])
def test_add_rms_norm(n, e, with_h) -> None:
    g = torch.Generator(device="cuda").manual_seed(n * e)
    x = torch.randn(n, e, device="cuda", generator=g).to(BF16) * 3
    h = torch.randn(n, e, device="cuda", generator=g).to(BF16) if with_h else None
    w = (1 + 0.1 * torch.randn(e, device="cuda", generator=g)).to(BF16)
    (s1, n1), (s2, n2) = triton_ops.add_rms_norm(x, h, w, 1e-5), ref.add_rms_norm_reference(x, h, w, 1e-5)
    assert torch.equal(s1, s2)
    assert ulps(n1, n2).max() <= 1.0 and (n1 != n2).float().mean() < 0.02


def test_add_rms_norm_float32_weight() -> None:
    """A float32 norm weight (GGUF keeps norms in f32) gives float32 out, as the reference."""
    x, w = torch.randn(4, 576, device="cuda").to(BF16), 1 + 0.1 * torch.randn(576, device="cuda")
    (_, a), (_, b) = triton_ops.add_rms_norm(x, None, w, 1e-5), ref.add_rms_norm_reference(x, None, w, 1e-5)
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("n,h,kv,d", [(1, 16, 8, 128), (40, 32, 8, 128), (7, 9, 3, 64)])
def test_qwen3_head_norms_are_the_modules_rms_norm(n, h, kv, d) -> None:
    """paged.Fused.head_norms (Triton's add_rms_norm over [N*H, D]) on q and k as views of one
    joined projection: the modules' q_norm / k_norm (llama.RMSNorm over each head) within one bf16
    place, each norm's sum of squares in another order."""
    from service.model import llama, paged
    config = llama.LlamaConfig.parse({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 64, "head_dim": d,
                                      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": h,
                                      "num_key_value_heads": kv})
    attn = llama.Attention(config, 0, "cuda").to(BF16)
    g = torch.Generator(device="cuda").manual_seed(n * h)
    with torch.no_grad():
        attn.q_norm.weight.copy_(1 + 0.1 * torch.randn(d, device="cuda", generator=g))
        attn.k_norm.weight.copy_(1 + 0.1 * torch.randn(d, device="cuda", generator=g))
    qkv = torch.randn(n, (h + 2 * kv) * d, device="cuda", generator=g).to(BF16) * 3        # one projection's views
    q, k, _ = (t.view(n, heads, d) for t, heads in zip(qkv.split([h * d, kv * d, kv * d], 1), (h, kv, kv)))
    for got, want in zip(paged.Fused(triton_ops).head_norms(attn, q, k), paged.MODULES.head_norms(attn, q, k)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert ulps(got, want).max() <= 1.0 and (got != want).float().mean() < 0.02


def rotary(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 4000, (n,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    freqs = pos[:, None].float() / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat((freqs, freqs), -1)
    sin = emb.sin().to(BF16)
    return emb.cos().to(BF16), torch.cat((-sin[:, :d // 2], sin[:, d // 2:]), -1)


@pytest.mark.parametrize("n,h,kv,d", [(1, 32, 32, 128), (9, 9, 3, 64), (40, 32, 8, 128), (0, 4, 2, 64)])
def test_rope_store(n, h, kv, d) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + h)
    qkv = torch.randn(n, (h + 2 * kv) * d, device="cuda", generator=g).to(BF16)      # one projection's views
    q, k, v = (t.view(n, heads, d) for t, heads in zip(qkv.split([h * d, kv * d, kv * d], 1), (h, kv, kv)))
    cos, sin = rotary(n, d, n)
    slots = torch.randperm(256, device="cuda", generator=g)[:n]
    caches = [torch.randn(256, kv, d, device="cuda", generator=g).to(BF16) for _ in range(2)]
    theirs = [c.clone() for c in caches]
    got = triton_ops.rope_store(q, k, v, cos, sin, *caches, slots)
    want = ref.rope_store_reference(q, k, v, cos, sin, *theirs, slots)
    assert torch.equal(got, want) and torch.equal(caches[0], theirs[0]) and torch.equal(caches[1], theirs[1])


def paged_case(b: int, h: int, kv: int, d: int, lengths: list[int], bs: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = max(-(-n // bs) for n in lengths)
    blocks = b * width + 1
    tables = torch.randperm(blocks, device="cuda", generator=g)[:b * width].view(b, width).contiguous()
    k_cache, v_cache = (torch.randn(blocks * bs, kv, d, device="cuda", generator=g).to(BF16) for _ in range(2))
    q = torch.randn(b, h, d, device="cuda", generator=g).to(BF16)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, device="cuda")


CASES = [(1, 32, 32, 128, [1], 16), (1, 32, 32, 128, [136], 16), (3, 32, 8, 128, [40, 17, 1], 16),
         (4, 9, 3, 64, [100, 33, 64, 65], 16), (2, 8, 8, 64, [31, 300], 32), (64, 32, 32, 128, list(range(8, 136, 2)), 16),
         (1, 32, 8, 128, [4000], 16), (5, 8, 8, 64, [63, 64, 65, 128, 129], 16), (2, 4, 4, 128, [48, 2], 64)]


@pytest.mark.parametrize("b,h,kv,d,lengths,bs", CASES)
def test_decode_attention(b, h, kv, d, lengths, bs) -> None:
    q, kc, vc, tables, lens = paged_case(b, h, kv, d, lengths, bs, b * 7 + h)
    got = triton_ops.decode_attention(q, kc, vc, tables, lens, bs, d ** -0.5)
    want = ref.decode_attention_reference(q, kc, vc, tables, lens, bs, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-3)


@pytest.mark.parametrize("b,h,kv,d,lengths,bs,window", [
    (3, 32, 8, 128, [40, 17, 1], 16, 16),                 # GQA's grouped kernel, one chunk of keys
    (4, 9, 3, 64, [100, 33, 64, 65], 16, 16),             # grouped, chunks before the window skipped
    (5, 8, 8, 64, [63, 64, 65, 128, 129], 16, 64),        # per-head kernel, windows on chunk bounds
    (2, 4, 4, 128, [300, 2], 64, 100), (1, 32, 8, 128, [4000], 16, 3000), (1, 32, 8, 128, [4000], 16, 1)])
def test_decode_attention_with_a_sliding_window(b, h, kv, d, lengths, bs, window) -> None:
    """The window in Triton's kernels: row b's query sees the keys at positions >= lengths[b] -
    window (transformers' `key > query - window`), as the reference and the CPU engine's path
    (paged's modules: SDPA over the gathered keys under llama.visible's mask, float32 on the CPU) do."""
    from service.model import paged
    q, kc, vc, tables, lens = paged_case(b, h, kv, d, lengths, bs, b * 5 + window)
    got = triton_ops.decode_attention(q, kc, vc, tables, lens, bs, d ** -0.5, window)
    want = ref.decode_attention_reference(q, kc, vc, tables, lens, bs, d ** -0.5, window)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-3)
    ctx = paged.Context(lens.cpu(), lens.cpu(), b, tables.cpu(), lens.cpu())
    paged._masks(ctx, bs, torch.device("cpu"), True, window)
    cpu = paged.MODULES.decode_attention(q.cpu().float(), kc.cpu().float(), vc.cpu().float(), ctx, bs, d ** -0.5, window)
    torch.testing.assert_close(got.cpu().float(), cpu, rtol=1.6e-2, atol=2e-3)
    assert not torch.allclose(got, triton_ops.decode_attention(q, kc, vc, tables, lens, bs, d ** -0.5),
                              rtol=1.6e-2, atol=2e-3)                 # the window hides keys of every case


def test_decode_attention_is_the_same_in_any_batch() -> None:
    """A row's output does not depend on the batch around it: alone with its own table (one
    chunk of keys or a few) it is bit for bit what it gets beside a row of 4 000 keys, whose
    wider table cuts every row's keys into chunks (step_triton.ATTENTION_CHUNK)."""
    lengths = [40, 64, 65, 300, 4000]
    q, kc, vc, tables, lens = paged_case(len(lengths), 8, 2, 128, lengths, 16, 3)
    together = triton_ops.decode_attention(q, kc, vc, tables, lens, 16, 128 ** -0.5)
    for r, n in enumerate(lengths[:-1]):
        table = tables[r:r + 1, :-(-n // 16)].contiguous()
        alone = triton_ops.decode_attention(q[r:r + 1], kc, vc, table, lens[r:r + 1], 16, 128 ** -0.5)
        assert torch.equal(alone, together[r:r + 1]), n


@pytest.mark.parametrize("b,h,kv,d,lengths", [(3, 32, 8, 128, [40, 17, 1]), (4, 9, 3, 64, [100, 33, 64, 65]),
                                               (8, 32, 8, 128, [2048] * 8), (2, 8, 1, 128, [300, 64])])
def test_grouped_attention_keeps_the_per_head_kernels_precision(b, h, kv, d, lengths, monkeypatch) -> None:
    """GQA's grouped kernel (tensor-core dots, P.V from P's two bf16 parts) gives the per-head
    kernel's output (float32 products and sums) but for the order of the sums: under 1 % of the
    outputs differ (P rounded to bf16 moved about 35 %), by at most a bf16 place of their head's
    largest output (an output near 0 is a sum that cancels: a place of its own is no measure)."""
    from cuda_ext import step_triton
    q, kc, vc, tables, lens = paged_case(b, h, kv, d, lengths, 16, b + h)
    grouped = triton_ops.decode_attention(q, kc, vc, tables, lens, 16, d ** -0.5)
    monkeypatch.setattr(step_triton, "ATTENTION_GROUPED", False)
    per_head = triton_ops.decode_attention(q, kc, vc, tables, lens, 16, d ** -0.5)
    place = torch.finfo(BF16).eps * per_head.float().abs().amax(-1, keepdim=True)
    assert ((grouped.float() - per_head.float()).abs() <= place).all()
    assert (grouped != per_head).float().mean() < 0.01


def test_decode_attention_fuzzed() -> None:
    rng = torch.Generator().manual_seed(11)
    for trial in range(25):
        r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=rng))
        kv = r(1, 5)
        b, h, d, bs = r(1, 9), kv * r(1, 5), [32, 64, 128][r(0, 3)], [8, 16, 32][r(0, 3)]
        lengths = [r(1, 400) for _ in range(b)]
        q, kc, vc, tables, lens = paged_case(b, h, kv, d, lengths, bs, trial)
        got = triton_ops.decode_attention(q, kc, vc, tables, lens, bs, d ** -0.5)
        want = ref.decode_attention_reference(q, kc, vc, tables, lens, bs, d ** -0.5)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-3, msg=f"trial {trial}")


@pytest.mark.parametrize("n,f", [(1, 11008), (5, 1536), (64, 11008), (3, 1000)])
def test_silu_mul(n, f) -> None:
    gu = torch.randn(n, 2 * f, device="cuda", generator=torch.Generator(device="cuda").manual_seed(f)).to(BF16) * 4
    gate, up = gu[:, :f], gu[:, f:]                                      # halves of one projection
    got, want = triton_ops.silu_mul(gate, up), ref.silu_mul_reference(gate, up)
    assert ulps(got, want).max() <= 1.0 and (got != want).float().mean() < 1e-3


@pytest.mark.parametrize("n", [7, 12, 16, 17, 24, 32, 40, 64])
@pytest.mark.parametrize("cols", [4096, 1000])
def test_the_kernels_write_a_fused_linears_x_layout(n, cols) -> None:
    """add + RMSNorm and SiLU * up asked for a fused fixed-rate linear's x layout at n rows: their
    row-major output in that layout (fixedrate.permute) bit for bit, zeros past its rows and columns;
    the residual sum unchanged."""
    from cuda_ext import fixedrate
    g = torch.Generator(device="cuda").manual_seed(n + cols)
    x, h = (torch.randn(n, cols, device="cuda", generator=g).to(BF16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(cols, device="cuda", generator=g)).to(BF16)
    gu = torch.randn(n, 2 * cols, device="cuda", generator=g).to(BF16) * 4
    with fixedrate.fused_rows(fixedrate.FUSED_MAX_ROWS):
        layout = fixedrate.permuted_rows(n), fixedrate.permuted_cols(cols)
        total, out = triton_ops.add_rms_norm(x, h, w, 1e-5)
        total_p, out_p = triton_ops.add_rms_norm(x, h, w, 1e-5, *layout)
        assert torch.equal(total_p, total) and torch.equal(out_p, fixedrate.permute(out).data)
        assert torch.equal(triton_ops.add_rms_norm(x, None, w, 1e-5, *layout)[1],
                           fixedrate.permute(triton_ops.add_rms_norm(x, None, w, 1e-5)[1]).data)
        plain = triton_ops.silu_mul(gu[:, :cols], gu[:, cols:])
        assert torch.equal(triton_ops.silu_mul(gu[:, :cols], gu[:, cols:], *layout), fixedrate.permute(plain).data)


def small_llama(seed: int, **extra):
    """A 4-layer GQA Llama on the GPU, bf16, norms N(1, 0.02) and matrices N(0, 0.05)."""
    from service.model import llama
    config = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
              **extra}
    torch.manual_seed(seed)
    m = llama.LlamaForCausalLM(llama.LlamaConfig.parse(config), "cuda").to(BF16).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.02 * torch.randn_like(p) if p.dim() == 1 else 0.05 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("extra", [{}, {"model_type": "mistral", "sliding_window": 16},
                                   {"model_type": "qwen3", "head_dim": 128}], ids=["llama", "window-16", "qwen3"])
@torch.inference_mode()
def test_the_triton_step_equals_the_modules_step(extra) -> None:
    """A small Llama's paged forward (prompt chunks, then decode rows replayed as a CUDA graph)
    with Triton's kernels and with the modules: logits within four bf16 places of the largest,
    greedy picks equal or tied to a place. With a window of 16 (a Mistral), the prompts of 25
    to 27 tokens and their decode rows see past it; a Qwen3 of head_dim 128 (not 512 / 8) normalises
    each head's q and k before rotary (its q_norm and k_norm are the norms small_llama perturbs)."""
    from service.engine.runner import Chunk, Decode, Runner
    from service.model import paged
    m = small_llama(seed=0, **extra)
    runs = {}
    for kind, fused in (("triton", triton_ops), ("modules", None)):
        cache = paged.PagedCache(m.config, 16, 16, BF16, torch.device("cuda"))
        runner = Runner(m, cache, max_rows=4, max_blocks=8, graphs=True, fused=fused)
        tables = [[2 * i, 2 * i + 1, 8 + i] for i in range(3)]
        first = [runner.run([], [Chunk(list(range(5 + i, 30 + i)), 0, t)]) for i, t in enumerate(tables)]
        decodes = [Decode(int(f[0].argmax()), 25, t) for f, t in zip(first, tables)]
        runs[kind] = torch.cat(first), runner.run(decodes, []).clone()
        assert runner.graphs                                             # the decode step was replayed
    for a, b in zip(runs["triton"], runs["modules"]):
        place = torch.finfo(BF16).eps * float(b.abs().max())             # a bf16 place at the largest logit
        torch.testing.assert_close(a, b, rtol=0, atol=4 * place)
        picked = b.gather(-1, a.argmax(-1)[:, None])[:, 0]                # Triton's pick, by the modules' logits
        assert (b.max(-1).values - picked <= place).all()                 # their top, or tied with it to a place


@torch.inference_mode()
def test_a_short_prompt_replays_the_graph_of_its_rows(monkeypatch) -> None:
    """A step of short prompts (tokens as decode rows), alone or beside decoding rows, replays the
    captured graph of its shape and calls no eager forward; its logits and the cache it writes
    match the eager step's (within four bf16 places: cuBLAS may sum a padded batch in another
    order), and the picks of every step are the eager step's or tied with them to a place. Before
    its graph is captured it runs eagerly (a capture never lands on a first token)."""
    from service.engine.runner import Chunk, Decode, Runner
    from service.model import paged
    m = small_llama(seed=1)
    forwards = []
    eager_forward = paged.forward
    monkeypatch.setattr(paged, "forward", lambda *a, **k: forwards.append(1) or eager_forward(*a, **k))
    prompt, other = Chunk(list(range(7, 18)), 0, [0]), Chunk(list(range(40, 45)), 0, [2])     # 11 and 5 tokens
    steps = {}
    for kind in ("eager", "replayed"):
        cache = paged.PagedCache(m.config, 8, 16, BF16, torch.device("cuda"))
        runner = Runner(m, cache, max_rows=32, max_blocks=4, graphs=True, fused=triton_ops)
        if kind == "replayed":
            while runner.capture_next():
                pass
        forwards.clear()
        first = runner.run([], [prompt]).clone()                        # 11 rows: the 16-row graph
        decode = Decode(int(first[0].argmax()), 11, [0])
        mixed = runner.run([decode], [other]).clone()                   # a decode row and a prompt: 6 rows
        eager_forwards = len(forwards)
        then = runner.run([Decode(int(mixed[0].argmax()), 12, [0]), Decode(int(mixed[1].argmax()), 5, [2])], [])
        written = slice(0, 3 * 16)                                      # the slots of blocks 0..2
        steps[kind] = (first, mixed, then.clone(), cache.k[:, written].clone(), cache.v[:, written].clone(),
                       eager_forwards)
    assert steps["eager"][-1] == 2 and steps["replayed"][-1] == 0
    for a, b in zip(steps["replayed"][:-1], steps["eager"][:-1]):
        place = torch.finfo(BF16).eps * float(b.abs().max())           # a bf16 place at the largest value
        torch.testing.assert_close(a, b, rtol=0, atol=4 * place)
    for a, b in zip(steps["replayed"][:3], steps["eager"][:3]):        # the replay's picks: the eager top, or tied
        place = torch.finfo(BF16).eps * float(b.abs().max())
        assert (b.max(-1).values - b.gather(-1, a.argmax(-1)[:, None])[:, 0] <= place).all()


@torch.inference_mode()
def test_fixed_linears_read_x_as_the_step_kernels_write_it(monkeypatch) -> None:
    """A small Llama's matrices in compressed mode's fixed-rate form, its paged steps through the
    Triton kernels (a prompt of 25 tokens: n8 tiles; one of 10: an m16 tile; 2 decode rows: x in
    place): with add + RMSNorm and SiLU * up writing x in the fused kernels' layouts, the logits and
    the cache are the bits of the step that writes x row-major (each op then permuting it)."""
    from cuda_ext import fixedrate
    from service.engine.runner import Chunk, Decode, Runner
    from service.model import fixed, llama, paged
    m = small_llama(seed=2)
    for layer in m.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name, module in list(owner.named_children()):
                if type(module) is llama.Linear:
                    setattr(owner, name, fixed.FixedLinear(fixedrate.encode(module.weight.detach().contiguous()), None))
    paged.fuse_projections(m)
    chosen, permuted_for = [], fixed.permuted_for
    counted = lambda readers, rows: chosen.append(permuted_for(readers, rows)[0]) or permuted_for(readers, rows)
    runs = {}
    for kind, choose in (("permuted", counted), ("row-major", lambda readers, rows: (0, 0))):
        monkeypatch.setattr(fixed, "permuted_for", choose)
        cache = paged.PagedCache(m.config, 8, 16, BF16, torch.device("cuda"))
        runner = Runner(m, cache, max_rows=32, max_blocks=4, graphs=False, fused=triton_ops)
        long = runner.run([], [Chunk(list(range(5, 30)), 0, [0, 1])])
        short = runner.run([], [Chunk(list(range(40, 50)), 0, [2])])
        then = runner.run([Decode(int(long[0].argmax()), 25, [0, 1]), Decode(int(short[0].argmax()), 10, [2])], [])
        runs[kind] = long, short, then, cache.k.clone(), cache.v.clone()
    assert sorted(set(chosen)) == [0, 16, 32]                        # 3 readers a layer: each layout, and in place
    for a, b in zip(runs["permuted"], runs["row-major"]):
        assert torch.equal(a, b)


def test_warm_up_compiles_the_variants_a_step_takes() -> None:
    """After warm_up with a model's dimensions, a decode step and a prompt's step of that model
    compile nothing new (Triton's per-kernel caches of compiled variants stop growing)."""
    from cuda_ext import step_triton
    jitted = [step_triton._add_rms_norm_kernel, step_triton._rope_store_kernel, step_triton._decode_attention_kernel,
              step_triton._decode_attention_group_kernel, step_triton._attention_combine_kernel,
              step_triton._silu_mul_kernel]
    variants = lambda: sum(len(entry[0]) for k in jitted for entry in k.device_caches.values())   # compiled
    assert ref.warm_up(torch.device("cuda"), BF16, 576, 1536, 9, 3, 64, 16)
    before = variants()
    for lengths in ([40, 17, 1], [300, 17, 1], [256], [1]):           # widths 3, 19, 16, 1: one chunk, several
        q, kc, vc, tables, lens = paged_case(len(lengths), 9, 3, 64, lengths, 16, 5)
        triton_ops.decode_attention(q, kc, vc, tables, lens, 16, 0.125)
    assert variants() == before


def test_warm_up_compiles_a_qwen3s_head_norms() -> None:
    """With `qk_norm` (a Qwen3's config), warm_up also compiles add + RMSNorm over rows of
    head_dim: the q_norm and k_norm of a step's tokens then compile nothing new."""
    from cuda_ext import step_triton
    variants = lambda: sum(len(entry[0]) for entry in step_triton._add_rms_norm_kernel.device_caches.values())
    assert ref.warm_up(torch.device("cuda"), BF16, 576, 1536, 9, 3, 128, 16, qk_norm=True)
    before = variants()
    for rows in (1 * 9, 7 * 3, 40 * 9):                                 # a step's tokens times query or KV heads
        triton_ops.add_rms_norm(torch.randn(rows, 128, device="cuda").to(BF16), None,
                                torch.ones(128, device="cuda", dtype=BF16), 1e-6)
    assert variants() == before
