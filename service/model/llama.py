"""Llama-family causal LMs (llama, mistral, qwen2, qwen3) in plain PyTorch, gpt-fast style: the forward
pass and nothing else. Serving such a model imports torch and this file, not transformers, whose
model modules pull in torch._dynamo, sympy and scipy: seconds on the start-up's critical path.

* Module names are transformers' LlamaForCausalLM's, so checkpoint keys load unchanged; the
  numerics follow it (RMSNorm in float32, rotary tables in float32, SDPA attention).
* The call is the one the engine makes of a transformers model:
  `model(input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep)`
  -> `.logits`, `.past_key_values` (a KVCache: update, get_seq_length, batch_select_indices, crop).
* `LlamaForCausalLM(config, device="meta")` allocates nothing and runs no initialiser: in torch
  2.13 the first random init on `meta` imports torch._dynamo (seconds), so modules here never
  initialise; the decoded tensors are assigned over them.
* `LlamaConfig.parse(config.json)` returns None for anything this file does not implement
  exactly (another activation, a rope type other than default/linear/llama3, a sliding window
  on some layers only): such models are served by transformers' own classes (build.py). A
  window on every layer is `sliding_window` (`visible`), None where no sequence served
  (WCODEC_MAX_TOTAL_TOKENS, the positions) outgrows it. Qwen3 is Llama with an RMSNorm over
  each head's q and k (`q_norm`, `k_norm`) before rotary (`Attention.head_norms`).

    ids [B, S]   x [B, S, E]   q [B, H, S, D]   k, v [B, KV, T, D]   mask [B, 1, S, T] (True: attend)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from .kvcache import KVCache

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# transformers' class defaults, for a config.json that omits the field (transformers' AutoConfig reads it so)
TYPE_DEFAULTS = {"llama": {"max_position_embeddings": 2048},
                 "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
                 "qwen2": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
                 "qwen3": {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28,
                           "head_dim": 128, "num_key_value_heads": 32}}
QK_NORM = ("qwen3",)                           # RMSNorm of each head's q and k (q_norm, k_norm) before rotary


def _rope(d: dict) -> tuple[float, dict] | None:
    """(theta, scaling) from transformers 5's rope_parameters or 4's rope_theta/rope_scaling."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    return (theta, {**params, "rope_type": kind}) if kind in ("default", "linear", "llama3") else None


INVALID_CONFIG = (ValueError, KeyError, TypeError, ArithmeticError)   # what LlamaConfig.parse raises


def sliding_window(d: dict) -> tuple[int | None, int]:
    """(the window, how many layers it windows) of config.json's `d` (TYPE_DEFAULTS applied), as
    transformers applies it: Mistral every layer (`layer_types` ignored); Qwen2 and Qwen3 with
    `use_sliding_window` the layers `layer_types` marks "sliding_attention", else those from
    `max_window_layers` on; Llama none."""
    kind, window = d.get("model_type"), d.get("sliding_window")
    switched_on = kind == "mistral" or (kind in ("qwen2", "qwen3") and d.get("use_sliding_window"))
    if window is None or not switched_on:
        return None, 0
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, not {window!r}")
    layers = d["num_hidden_layers"]
    if kind == "mistral":
        return window, layers
    types = d.get("layer_types") or ["sliding_attention" if i >= d["max_window_layers"] else "full_attention"
                                     for i in range(layers)]
    return window, types.count("sliding_attention")


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope: dict = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    sliding_window: int | None = None           # every layer's window, where one hides keys of a sequence served
    qk_norm: bool = False                       # Attention's q_norm, k_norm (QK_NORM)

    @classmethod
    def parse(cls, d: dict, context: int | None = None) -> LlamaConfig | None:
        """The config of config.json's `d`, None for a model llama.py does not implement; raises
        one of INVALID_CONFIG for a config that is not valid (a field missing or mistyped, 0 heads).
        `context`: the longest sequence the service lets a request hold (WCODEC_MAX_TOTAL_TOKENS);
        None: the model's positions bound it alone."""
        kind = d.get("model_type")
        d = {**TYPE_DEFAULTS.get(kind, {}), **d}
        rope = _rope(d)
        if kind not in MODEL_TYPES or rope is None or d.get("hidden_act", "silu") != "silu" \
                or d.get("pretraining_tp", 1) != 1:
            return None
        window, windowed = sliding_window(d)
        if not windowed or window >= min(d["max_position_embeddings"], context or d["max_position_embeddings"]):
            window = None                               # no sequence served outgrows it
        elif windowed < d["num_hidden_layers"]:
            return None                                 # windowed layers beside full ones
        heads = d["num_attention_heads"]
        bias = bool(d.get("attention_bias", False))
        return cls(kind, d["vocab_size"], d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], heads,
                   d.get("num_key_value_heads") or heads, d.get("head_dim") or d["hidden_size"] // heads,
                   d.get("rms_norm_eps", 1e-6), rope[0], rope[1], d["max_position_embeddings"],
                   bool(d.get("tie_word_embeddings", False)), bias or kind == "qwen2",
                   bias, bool(d.get("mlp_bias", False)), d.get("eos_token_id"), d.get("pad_token_id"),
                   d.get("bos_token_id"), window, kind in QK_NORM)


def native_config(d: dict | None, context: int | None = None) -> LlamaConfig | None:
    """The config of config.json's `d` if this file serves the model, else None: no config, a model
    build.prepare gives to transformers' classes, or a config that is not valid (the load says why).
    For what is known before a load (the memory budget's estimate); `context`: as LlamaConfig.parse."""
    try:
        return LlamaConfig.parse(d, context) if d else None
    except INVALID_CONFIG:
        return None


EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def linear_weights(config: LlamaConfig, entries) -> tuple[list, list]:
    """Of a model of `config` whose archive's header lists `entries` (before a load: the memory
    budget's estimate), the entries of its Linears' weights -- every matrix but the embedding
    table, and the head's: its own, or with tie_word_embeddings the table -- and those another
    module holds too (the table a tied head shares: `tie_weights`)."""
    table = [e for e in entries if e.name == EMBEDDING]
    linears = [e for e in entries if len(e.shape) == 2 and e.name not in (EMBEDDING, HEAD)]
    if config.tie_word_embeddings:
        return linears + table, table
    return linears + [e for e in entries if e.name == HEAD], []


def inv_freq(c: LlamaConfig, device=None) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies [D/2] (float32) and the cos/sin scale, as transformers computes them."""
    d = c.head_dim
    freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / d))
    kind = c.rope["rope_type"]
    if kind == "linear":
        freq = freq / c.rope["factor"]
    elif kind == "llama3":                      # long wavelengths slowed by `factor`, short ones kept, smooth between
        factor, lo, hi = c.rope["factor"], c.rope["low_freq_factor"], c.rope["high_freq_factor"]
        old = c.rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / lo, freq / factor, freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        freq = torch.where(medium, smoothed, scaled)
    return freq, 1.0


def owner_of(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module that holds submodule `path` of `model`, and its attribute name there."""
    parent, _, attr = path.rpartition(".")
    return model.get_submodule(parent), attr


class Linear(nn.Linear):
    joinable = True                             # forward is `matmul` of its own weight and bias (paged.fuse_projections)

    def reset_parameters(self) -> None:         # weights are assigned, never initialised
        pass

    @staticmethod
    def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class Rotary(nn.Module):
    def __init__(self, config: LlamaConfig, device=None):
        super().__init__()
        if str(device) == "meta":               # a placeholder; build.assemble rebuilds it on the device
            freq, self.scale = torch.empty(config.head_dim // 2, device="meta"), 1.0
        else:
            freq, self.scale = inv_freq(config, device)
        self.inv_freq = nn.Buffer(freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)    # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                                # [B, S, D]
        return (emb.cos() * self.scale).to(x.dtype), (emb.sin() * self.scale).to(x.dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated: transformers' rotation
    `x * cos + rotate_half(x) * sin`, rotate_half(x) = (-x2, x1), is then
    `x * cos + x.roll(D/2) * signed_sin` (x.roll: (x2, x1)), the same products bit for bit
    ((-a) * b == a * (-b)) in one call where rotate_half took four."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size, device=device)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int, device=None):
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        e, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = Linear(e, q, bias=c.qkv_bias, device=device)
        self.k_proj = Linear(e, kv, bias=c.qkv_bias, device=device)
        self.v_proj = Linear(e, kv, bias=c.qkv_bias, device=device)
        self.o_proj = Linear(q, e, bias=c.o_bias, device=device)
        if c.qk_norm:                                                            # over each head's D
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device)

    def head_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., H, D], k [..., KV, D] normed by q_norm, k_norm where the model has them (Qwen3)."""
        return (self.q_norm(q), self.k_norm(k)) if hasattr(self, "q_norm") else (q, k)

    def forward(self, x: torch.Tensor, parts: list[Part]) -> torch.Tensor:
        """x [N, E]: the tokens of every part, one after another; the projections run on all of
        them at once, attention part by part (each part its own cache and mask)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)                 # [N, H*D], [N, KV*D]
        outs, start = [], 0
        for p in parts:
            rows = slice(start, start + p.tokens)
            outs.append(self._attend(q[rows], k[rows], v[rows], p))
            start += p.tokens
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Part) -> torch.Tensor:
        b, s = p.shape
        q, k = self.head_norms(q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim))
        q, k = q.transpose(1, 2), k.transpose(1, 2)                              # [B, H, S, D], [B, KV, S, D]
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        half = self.head_dim // 2
        q, k = q * p.cos + q.roll(half, -1) * p.sin, k * p.cos + k.roll(half, -1) * p.sin   # p.sin: signed
        if p.cache is not None:
            k, v = p.cache.update(k, v, self.layer)                                # [B, KV, T, D]
        out = grouped_attention(q, k, v, p.mask, self.head_dim ** -0.5)            # [B, H, S, D]
        return out.transpose(1, 2).reshape(b * s, -1)                              # [B*S, H*D]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """SDPA where G = H / KV query heads share each KV head, without repeating K and V G times:
    the G heads of a group are folded into the query length (head h reads KV head h // G, as
    transformers' `repeat_kv` has it), and each query row of the mask is repeated for them.
    Every query row meets the same keys, values and mask row as with repeated K/V, so the
    results differ at most in the summation order of a dot product (tests/service/model/test_llama.py);
    on the CPU the call is about 10x faster at a decoding step of 32 rows (the repeated K/V was
    a copy of the whole cache per layer and step, and SDPA's kernel was slower on it).

        q [B, H, S, D]   k, v [B, KV, T, D]   mask [B, 1, S, T] -> [B, H, S, D]"""
    b, h, s, d = q.shape
    kv, t = k.shape[1], k.shape[2]
    g = h // kv
    if s > 1 and g > 1:
        mask = mask[:, :, None].expand(b, 1, g, s, t).reshape(b, 1, g * s, t)  # row g*S + s: mask row s
    out = F.scaled_dot_product_attention(q.reshape(b, kv, g * s, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, s, d)             # [B, KV, G*S, D] -> heads (CUDA's SDPA may return it strided)


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig, device=None):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, device=device)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, device=device)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# The Linears a step multiplies as one (service/model/paged.py fuse_projections): a layer's child,
# the joined name, the parts that read one input.
JOINS = (("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up", ("gate_proj", "up_proj")))


class Layer(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int, device=None):
        super().__init__()
        self.self_attn, self.mlp = Attention(c, layer, device), MLP(c, device)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device)

    def forward(self, x: torch.Tensor, parts: list[Part]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), parts)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: LlamaConfig, device=None):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, device=device)
        self.layers = nn.ModuleList(Layer(c, i, device) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device)
        self.rotary_emb = Rotary(c, device)


@dataclass
class Segment:
    """Rows fed to the model together, with their own cache (`LlamaForCausalLM.forward_segments`)."""
    ids: torch.Tensor                          # [B, S]
    attention_mask: torch.Tensor               # [B, T]: the cache's columns and these, 1: a real token
    position_ids: torch.Tensor                 # [B, S]
    cache: KVCache | None


@dataclass
class Part:
    """A segment as the layers see it: its place in the flat tokens, its rotary table and mask."""
    shape: tuple[int, int]                     # (B, S)
    cos: torch.Tensor                          # [B, 1, S, D]
    sin: torch.Tensor                          # [B, 1, S, D], first half negated (_signed_sin)
    mask: torch.Tensor                         # [B, 1, S, T] bool
    cache: KVCache | None

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor                       # [B, S or logits_to_keep, V]
    past_key_values: KVCache | None


def visible(keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether the queries see the keys (positions, broadcast): causal, within `window`
    (transformers' masking_utils.sliding_window_overlay: key > query - window)."""
    seen = keys <= queries
    return seen if window is None else seen & (keys > queries - window)


def causal_mask(mask: torch.Tensor, q_len: int, window: int | None = None) -> torch.Tensor:
    """[B, T] (1: a real token) -> [B, 1, q_len, T] bool: causal (within `window`: a row's real tokens
    are contiguous, service/engine/kv.py), no padding keys; a query always sees itself, so a
    padding row is never empty (no NaN in SDPA)."""
    t = mask.shape[1]
    keys = torch.arange(t, device=mask.device)                                     # [T]
    queries = torch.arange(t - q_len, t, device=mask.device)[:, None]              # [S, 1]
    allowed = visible(keys, queries, window)[None, None] & mask[:, None, None, :].bool()   # [B, 1, S, T]
    return allowed | (keys == queries)[None, None]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig, device=None):
        super().__init__()
        self.config = config
        self.model = Backbone(config, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and not getattr(self.lm_head, "holds_blocks", False):   # quantized.py
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool = True, logits_to_keep: int = 0, **_) -> CausalLMOutput:
        b, s = input_ids.shape
        cache = past_key_values if past_key_values is not None else (KVCache() if use_cache else None)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=input_ids.device).expand(b, s)
        if attention_mask is None:
            attention_mask = torch.ones(b, past + s, dtype=torch.long, device=input_ids.device)
        (logits,) = self.forward_segments([Segment(input_ids, attention_mask, position_ids, cache)], logits_to_keep)
        return CausalLMOutput(logits, cache)

    def forward_segments(self, segments: list[Segment], logits_to_keep: int = 0) -> list[torch.Tensor]:
        """One pass over several batches, each with its own cache: every Linear runs once on all
        their tokens (a decoding step's rows and a prompt's chunk share each weight's one
        read), attention runs per segment. Returns each segment's logits [B, S or logits_to_keep, V]."""
        xs = [self.model.embed_tokens(seg.ids) for seg in segments]               # [B, S, E] each
        parts = [self._part(x, seg) for x, seg in zip(xs, segments)]
        x = torch.cat([x.flatten(0, 1) for x in xs]) if len(xs) > 1 else xs[0].flatten(0, 1)   # [N, E]
        for layer in self.model.layers:
            x = layer(x, parts)
        kept = [self._kept(rows, p, logits_to_keep) for rows, p in zip(x.split([p.tokens for p in parts]), parts)]
        logits = self.lm_head(self.model.norm(torch.cat([k.flatten(0, 1) for k in kept])))     # [sum B*K, V]
        return [out.view(*k.shape[:2], -1) for out, k in zip(logits.split([k.shape[0] * k.shape[1] for k in kept]),
                                                             kept)]

    @staticmethod
    def _kept(rows: torch.Tensor, p: Part, logits_to_keep: int) -> torch.Tensor:
        """A part's flat rows [B*S, E] -> the positions that get logits [B, S or logits_to_keep, E]."""
        rows = rows.view(*p.shape, -1)
        return rows[:, -logits_to_keep:] if logits_to_keep else rows

    def _part(self, x: torch.Tensor, seg: Segment) -> Part:
        cos, sin = self.model.rotary_emb(x, seg.position_ids)                      # [B, S, D]
        mask = causal_mask(seg.attention_mask, seg.ids.shape[1], self.config.sliding_window)
        return Part(tuple(seg.ids.shape), cos.unsqueeze(1), _signed_sin(sin).unsqueeze(1), mask, seg.cache)
