"""llama.py's models over a paged KV cache (vLLM / nano-vllm style): one forward of flat tokens,
every token's keys and values written into a slot of a cache allocated once, attention reading
them back through each row's block table. The engine's runner (service/engine/runner.py) builds
the `Context`; a decode-only context has fixed shapes, so its forward can be captured as a CUDA graph.

Read me first.
* The cache of a layer is flat slots: slot = block * block_size + offset. A row (a sequence) owns
  the blocks of its block table; its token at position p lives in slot table[p // bs] * bs + p % bs.
* The last block of the cache is padding: the padded rows of a captured batch write there and
  read only there, so they never touch a real row's keys.
* The first `decode` tokens are decode rows (one new token each, attention over their block
  tables, batched); the rest are prompt chunks (`Prefill`), attended one sequence at a time.
* Two ways to run a step, one forward: `Modules` calls llama.py's modules (compressed mode's
  hooks fire as they do there), the maths of Layer.forward token for token (the same rotary
  products, RMSNorm, SDPA); `Fused` (CUDA) runs the small ops as Triton kernels
  (cuda_ext/step_triton.py: add + RMSNorm, rotary + cache write, paged decode attention,
  SiLU * up; Qwen3's q_norm and k_norm as the add + RMSNorm kernel over rows of head_dim, before the
  fused rotary), equal to those up to float32 summation order; the projections stay the modules'.
  On the CPU `Fused` runs the extension's twins (cuda_ext/csrc/step_cpu.cpp: add + RMSNorm, rotary
  + cache write, the decode rows' gather and SDPA in one call each), equal to the modules' bit for bit.

    ids, positions, slots [N]   x [N, E]   q [N, H, D]   k, v [N, KV, D]
    cache k, v [L, slots, KV, D]   tables [B, M] (blocks)   lengths [B] (keys a decode row sees)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cuda_ext import fixedrate, step_kernels

from . import device_wide, fixed, llama


@dataclass
class Prefill:
    """One sequence's prompt chunk: tokens start:start + length of the step, after `past` keys."""
    start: int                     # first token in the step's flat tokens
    length: int                    # S: tokens of the chunk
    past: int                      # keys before the chunk (the prompt's earlier chunks)
    context: torch.Tensor          # [past + S] slots of every key the chunk sees, in order
    mask: torch.Tensor | None = None   # [1, 1, S, past + S] causal (set by `forward`)


@dataclass
class Context:
    positions: torch.Tensor        # [N] int64
    slots: torch.Tensor            # [N] int64: where each token's keys and values go
    decode: int                    # B: the first B tokens are decode rows
    tables: torch.Tensor | None    # [B, M] int64 block tables of the decode rows
    lengths: torch.Tensor | None   # [B] int64: keys each decode row sees (its new token included)
    prefills: list[Prefill] = field(default_factory=list)
    last: torch.Tensor | None = None   # [R] tokens whose logits are wanted; None: all
    keys: int | None = None        # T: key columns decode rows gather (>= max(lengths)); None: M * block_size
    mask: torch.Tensor | None = None   # [B, 1, 1, T] the decode rows' keys (set by `forward`)


class PagedCache:
    """Keys and values of every layer, allocated once: [L, (blocks + 1) * block_size, KV, D],
    zeroed (a masked key's weight is 0, and 0 times a finite value stays 0)."""

    def __init__(self, config: llama.LlamaConfig, blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.blocks, self.block_size = blocks, block_size
        shape = (config.num_hidden_layers, (blocks + 1) * block_size, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def pad_block(self) -> int:
        return self.blocks

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def token_bytes(config: llama.LlamaConfig, dtype: torch.dtype) -> int:
        """Bytes one token's keys and values take over all layers."""
        size = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * size


def forward(model: llama.LlamaForCausalLM, ids: torch.Tensor, ctx: Context, cache: PagedCache,
            fused=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [R, V] (float32) of the tokens `ctx.last` (all N when None), after writing every
    token's keys and values into `cache`; into `out` when given (a float32 [R, V] view: the runner's
    graphs share one). `fused`: cuda_ext/step_triton.py or step_kernels.cpu_kernels (their kernels
    read the norms' weights directly: compressed mode keeps them decoded); None: the modules, called."""
    m, ops, window = model.model, (Fused(fused) if fused is not None else MODULES), model.config.sliding_window
    _masks(ctx, cache.block_size, ids.device, fused is None or window is not None, window)   # once a step
    x = m.embed_tokens(ids)                                                        # [N, E]
    cos, sin = m.rotary_emb(x, ctx.positions)                                      # [N, D]
    sin, h = llama._signed_sin(sin), None
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _readers(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj))
        x, normed = ops.add_norm(x, h, layer.input_layernorm, qkv)                # x += h; RMSNorm
        h = attention(attn, normed, cos, sin, ctx, (cache.k[i], cache.v[i]), cache.block_size, ops, window)
        gate_up = _readers(mlp, "gate_up", (mlp.gate_proj, mlp.up_proj))
        x, normed = ops.add_norm(x, h, layer.post_attention_layernorm, gate_up)
        h = ops.mlp(mlp, normed)
    x = x + h
    if ctx.last is not None:
        x = x[ctx.last]                                                            # [R, E]
    logits = model.lm_head(m.norm(x))                                              # [R, V]
    return logits.float() if out is None else out.copy_(logits)


class Modules:
    """The eager step: the model's modules, called (compressed mode's hooks fire), or where
    `fuse_projections` joined them, their joined weights; the keys a decode row sees gathered by
    block and attended by SDPA (`_decode`)."""
    rope_store = staticmethod(step_kernels.rope_store_reference)
    silu_mul = staticmethod(step_kernels.silu_mul_reference)

    @staticmethod
    def add_norm(x: torch.Tensor, h: torch.Tensor | None, norm: llama.RMSNorm,
                 readers: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """x += h, and the norm of x for `readers` (the Linears that read it)."""
        x = x if h is None else x + h
        return x, norm(x)

    @staticmethod
    def projections(attn: llama.Attention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _joined(attn, "qkv", (attn.q_proj, attn.k_proj, attn.v_proj), x)

    @staticmethod
    def head_norms(attn: llama.Attention, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.head_norms(q, k)                                               # Qwen3's q_norm, k_norm

    def mlp(self, mlp: llama.MLP, x: torch.Tensor) -> torch.Tensor:
        gate, up = _joined(mlp, "gate_up", (mlp.gate_proj, mlp.up_proj), x)
        return mlp.down_proj(self.silu_mul(gate, up))                             # MLP.forward's maths

    @staticmethod
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context,
                         block_size: int, scale: float, window: int | None = None) -> torch.Tensor:
        return _decode(q, k_cache, v_cache, ctx, block_size, scale)             # ctx.mask holds the window


MODULES = Modules()


class Fused(Modules):
    """The step of Triton kernels (cuda_ext/step_triton.py), or on the CPU of the extension's ops
    (step_kernels.cpu_kernels): add + RMSNorm, rotary + cache write, paged decode attention, SiLU *
    up; the projections as the modules' step has them."""

    def __init__(self, kernels):
        self.k, self.rope_store, self.silu_mul = kernels, kernels.rope_store, kernels.silu_mul

    def add_norm(self, x: torch.Tensor, h: torch.Tensor | None, norm: llama.RMSNorm, readers: tuple = ()) -> tuple:
        """The norm written in the fused kernel's x layout where every reader is a FixedLinear that
        takes it (fixed.permuted_for): a fixedrate.PermutedX, so their op launches no permute."""
        rows, width = fixed.permuted_for(readers, x.shape[0])
        if not rows:
            return self.k.add_rms_norm(x, h, norm.weight, norm.eps)
        total, out = self.k.add_rms_norm(x, h, norm.weight, norm.eps, rows, width)
        return total, fixedrate.PermutedX(out, *x.shape)

    def head_norms(self, attn: llama.Attention, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Qwen3's q_norm, k_norm by the kernels' RMSNorm over rows of D (a token's head each), before
        the fused rotary reads q and k: two launches a layer more (and q, k copied dense), not fused."""
        if not hasattr(attn, "q_norm"):
            return q, k
        return tuple(self.k.add_rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), None, norm.weight, norm.eps)[1]
                     .view(x.shape) for x, norm in ((q, attn.q_norm), (k, attn.k_norm)))

    def mlp(self, mlp: llama.MLP, x) -> torch.Tensor:
        gate, up = _joined(mlp, "gate_up", (mlp.gate_proj, mlp.up_proj), x)
        rows, width = fixed.permuted_for((mlp.down_proj,), gate.shape[0])
        if not rows:
            return mlp.down_proj(self.silu_mul(gate, up))
        return mlp.down_proj(fixedrate.PermutedX(self.silu_mul(gate, up, rows, width), *gate.shape))

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context,
                         block_size: int, scale: float, window: int | None = None) -> torch.Tensor:
        """The kernels' op; with a sliding window, theirs where they take one (`windows`: Triton's,
        the references), else the modules' (the CPU op attends every key of a row)."""
        if window is None:
            return self.k.decode_attention(q, k_cache, v_cache, ctx.tables, ctx.lengths, block_size, scale)
        if getattr(self.k, "windows", False):
            return self.k.decode_attention(q, k_cache, v_cache, ctx.tables, ctx.lengths, block_size, scale, window)
        return _decode(q, k_cache, v_cache, ctx, block_size, scale)


WARM_UP_CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """The eager step of a toy model once as the engine's first request takes it (a prompt chunk,
    then a decode row, joined projections, the greedy pick), so that the kernels it launches are
    loaded before that request: CUDA loads each kernel at its first launch, 0.4 s of the H100's
    first 7B step after start-up (docs/BENCHMARKS.md)."""
    config = llama.LlamaConfig.parse(WARM_UP_CONFIG)
    model = llama.LlamaForCausalLM(config, device=device)
    for p in model.parameters():                                   # never initialised (llama.Linear)
        p.data = (0.02 * torch.randn(p.shape, device=device)).to(dtype)
    fuse_projections(model)
    cache = PagedCache(config, 1, 16, dtype, device)
    with torch.inference_mode():
        slots = torch.arange(5, device=device)
        ids = torch.tensor([1, 2, 3, 4, 5], device=device)
        prompt = Context(slots, slots, 0, None, None, [Prefill(0, 5, 0, slots)], torch.tensor([4], device=device))
        forward(model, ids, prompt, cache)
        five = torch.tensor([5], device=device)
        step = Context(five, five, 1, torch.zeros(1, 1, dtype=torch.long, device=device), five + 1, keys=6)
        forward(model, ids[:1], step, cache).log_softmax(-1).max(-1)
    if device.type == "cuda":
        device_wide.synchronize(device)


def fuse_projections(model: llama.LlamaForCausalLM) -> None:
    """Each layer's q, k, v and gate, up weights joined into one [sum of outs, in] buffer
    (`qkv_weight`, `gate_up_weight`): one matmul of each set, about 5% of a 7B step at batch 1
    on an H100, and on the CPU's linear16 bit for bit the same outputs in fewer calls
    (docs/BENCHMARKS.md). The modules' weights become row views of the joined buffer, so no
    byte is held twice, the modules still compute alone, and `model.to("meta")` (an unload)
    frees it. Only `joinable` Linears of one class and dtype, all with bias or none; once.
    FixedLinears (compressed mode's fixed-rate form) join their own way (fixed.FixedLinear.join)."""
    for layer in model.model.layers:
        for child, name, parts in llama.JOINS:
            owner = getattr(layer, child)
            _join(owner, name, tuple(getattr(owner, p) for p in parts))


def _join(parent: torch.nn.Module, name: str, parts: tuple[torch.nn.Linear, ...]) -> None:
    join = getattr(type(parts[0]), "join", None)              # a held form's own (fixed.FixedLinear)
    if join is not None:
        return join(parent, name, parts)
    if hasattr(parent, f"{name}_weight") or not getattr(type(parts[0]), "joinable", False) \
            or len({(type(p), p.weight.dtype, p.bias is None, getattr(p, 'packed', False)) for p in parts}) != 1:
        return
    for kind in ("weight", "bias"):
        if getattr(parts[0], kind) is None:
            parent.register_buffer(f"{name}_{kind}", None, persistent=False)
            continue
        joined = torch.cat([getattr(p, kind).detach() for p in parts])              # [sum of outs, ...]
        parent.register_buffer(f"{name}_{kind}", joined, persistent=False)
        for p, rows in zip(parts, joined.split([p.out_features for p in parts])):
            setattr(p, kind, torch.nn.Parameter(rows, requires_grad=False))


def _readers(parent: torch.nn.Module, name: str, parts: tuple[torch.nn.Linear, ...]) -> tuple[torch.nn.Module, ...]:
    """The Linears that read the parts' input in a step: their joined one, else each part (_joined)."""
    linear = getattr(parent, f"{name}_linear", None)
    return parts if linear is None else (linear,)


def _joined(parent: torch.nn.Module, name: str, parts: tuple[torch.nn.Linear, ...],
            x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each part's output: one matmul over the joined weight (column views of it), else each module."""
    linear = getattr(parent, f"{name}_linear", None)         # FixedLinears joined
    if linear is not None:
        return linear(x).split([p.out_features for p in parts], -1)
    weight = getattr(parent, f"{name}_weight", None)
    if weight is None:
        return tuple(p(x) for p in parts)
    joined = parts[0].matmul(x, weight, getattr(parent, f"{name}_bias"))
    return joined.split([p.out_features for p in parts], -1)


def _masks(ctx: Context, block_size: int, device: torch.device, decode: bool, window: int | None = None) -> None:
    """The decode rows' mask (where `decode`: the modules attend them) and each chunk's: causal,
    within `window` (llama.visible; a decode row's query is at position lengths - 1)."""
    if ctx.decode and decode:
        keys = torch.arange(ctx.keys or ctx.tables.shape[1] * block_size, device=device)   # [T]
        ctx.mask = llama.visible(keys, ctx.lengths[:, None] - 1, window)[:, None, None, :]   # [B, 1, 1, T]
    for p in ctx.prefills:
        t = p.past + p.length
        keys, queries = torch.arange(t, device=device), torch.arange(p.past, t, device=device)[:, None]   # [T], [S, 1]
        p.mask = llama.visible(keys, queries, window)[None, None]                       # [1, 1, S, T]


def attention(attn: llama.Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: Context,
              kv: tuple[torch.Tensor, torch.Tensor], block_size: int, ops, window: int | None = None) -> torch.Tensor:
    """x [N, E] -> [N, E]: the projections on every token at once, rotary and the new keys and
    values into their slots `kv` (the layer's k and v caches), then attention of the decode rows
    (batched) and of each prompt chunk, within the model's sliding `window`. Blocks wholly
    before a row's window stay allocated (and are gathered by the modules' decode, masked)."""
    (k_cache, v_cache), n, d = kv, x.shape[0], attn.head_dim
    q, k, v = (t.view(n, -1, d) for t in ops.projections(attn, x))                 # [N, H, D], [N, KV, D]
    q, k = ops.head_norms(attn, q, k)                                              # Qwen3: before rotary
    q = ops.rope_store(q, k, v, cos, sin, k_cache, v_cache, ctx.slots)             # sin: signed
    scale, outs = d ** -0.5, []
    if ctx.decode:
        outs.append(ops.decode_attention(q[:ctx.decode], k_cache, v_cache, ctx, block_size, scale, window))
    for p in ctx.prefills:
        outs.append(_prefill(q[p.start:p.start + p.length], k_cache, v_cache, p, scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)                           # [N, H, D]
    return attn.o_proj(out.reshape(n, -1))


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, block_size: int,
            scale: float) -> torch.Tensor:
    """q [B, H, D]: each row's one query against the keys of its block table -> [B, H, D]."""
    b, m = ctx.tables.shape
    kv, d = k_cache.shape[1:]
    t = ctx.mask.shape[-1]
    blocks = ctx.tables.flatten()                                                  # index_select: a row copy
    k = k_cache.view(-1, block_size, kv, d).index_select(0, blocks).view(b, m * block_size, kv, d)[:, :t].transpose(1, 2)
    v = v_cache.view(-1, block_size, kv, d).index_select(0, blocks).view(b, m * block_size, kv, d)[:, :t].transpose(1, 2)
    return llama.grouped_attention(q[:, :, None], k, v, ctx.mask, scale)[:, :, 0]  # k, v [B, KV, T, D] -> [B, H, D]


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: Prefill,
             scale: float) -> torch.Tensor:
    """q [S, H, D]: a prompt chunk, causal over its `past` keys and itself -> [S, H, D]."""
    k = k_cache.index_select(0, p.context).transpose(0, 1)[None]                  # [1, KV, T, D]
    v = v_cache.index_select(0, p.context).transpose(0, 1)[None]
    out = llama.grouped_attention(q.transpose(0, 1)[None], k, v, p.mask, scale)    # [1, H, S, D]
    return out[0].transpose(0, 1)                                                  # [S, H, D]
