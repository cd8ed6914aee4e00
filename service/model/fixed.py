"""The fixed-rate form in compressed-resident mode on CUDA (docs/RESIDENT.md, FORMAT.md §6): each
float-coded matrix is decoded at load by the archive decoder, transcoded on the GPU into the
fixed-rate form (cuda_ext.fixedrate.encode, bit-exact) and its bf16 copy dropped. A Linear of
that form (`FixedLinear`) multiplies with the fused decode-matmul for 1 to 32 rows (the weights
decoded in registers; nothing written back), and up to 64 in a step of decode rows and whole short
prompts (`decode_only`, `fused_prompt`); for more rows (prompts, large batches) it decodes the
weight into a temporary and calls cuBLAS.

* About 0.71 of bf16 bytes: 0.697 fixed, plus two bytes for each escaped exponent (its entry).
* The embedding table, gathered by row, is decoded back at load and kept in page-locked host
  memory (`HostEmbedding`), as llama.cpp keeps its input layer on the CPU: a step reads its rows
  over the bus (8 KiB a token of a 7B), and the device holds only the matrices' form. A head tied
  to the table shares it on the device, as in decoded mode; any other matrix that is not a
  Linear's is decoded back onto the device.
* The fused op launches on the current stream with no host sync, so the engine's decode steps
  capture it in their CUDA graphs.

    form  plane [rows, groups*32] u8, lo [rows, groups*2] i32, hi [rows, groups] i32,
          tile [rows, tiles] i16, esc [escapes] i16, esc_start [rows, blocks] i32
"""
from __future__ import annotations

import torch

from codec import fixedrate as form
from codec.constants import CODEC_FLOAT
import cuda_ext
from cuda_ext import fixedrate, ops

from . import llama

ESCAPES = 0.02                   # escaped weights the estimate allows (trained-like 8B layer: ~0.012)
EMBEDDING = llama.EMBEDDING


def form_for(setting: str, device: torch.device) -> str:
    """The compressed form a load on `device` takes: "fixed" (WCODEC_COMPRESSED_FORM's default)
    on CUDA where the extension has the fixed-rate ops, else "indexed" (compressed.py; the CPU's)."""
    from cuda_ext import ops
    fits = device.type == "cuda" and cuda_ext.available().cuda and ops.has_ops(ops.FIXEDRATE_OPS, "cuda")
    return "fixed" if setting == "fixed" and fits else "indexed"


def decode_only_rows(model: torch.nn.Module) -> range:
    """The step rows (batch buckets) whose steps of decode rows (and `fused_prompt`'s) the fused op
    takes whole where a longer prompt's would decode and call cuBLAS: 33-64 where `model` holds a
    FixedLinear on CUDA, else none. Each of such a step's rows gets the sums it gets in a step of
    1-32 rows, which the fused op always takes; an 8B layer's seven matmuls at 64 rows cost 1.72 of
    cuBLAS's time there against 2.36 through the decoded scratch (H200, 2026-11-29)."""
    return range(fixedrate.FUSED_ROWS + 1, fixedrate.FUSED_MAX_ROWS + 1) if fused_on_cuda(model) else range(0)


def fused_on_cuda(model: torch.nn.Module) -> bool:
    """Whether `model` holds a FixedLinear on CUDA (its matmuls the fused op)."""
    return any(isinstance(m, FixedLinear) and m.plane.is_cuda for m in model.modules())


def decode_only(rows: int):
    """The block in which a step of `rows` rows (in decode_only_rows) whose rows are all decode rows
    (or `fused_prompt`'s) runs or is captured."""
    return fixedrate.fused_rows(rows)


def fused_prompt(tokens: int) -> bool:
    """Whether a whole prompt of `tokens` tokens may ride in such a step: prefilled alone it is
    one step of `tokens` rows, which the fused op takes (FUSED_ROWS or fewer), and each row's sums
    do not depend on its batch, so in the step its tokens get the sums they get alone. A longer
    prompt alone decodes and calls cuBLAS, so a step that holds it does too."""
    return tokens <= fixedrate.FUSED_ROWS


def keeps(e) -> bool:
    """Whether the fixed form holds a tensor: a float-coded bf16 matrix that is a weight (not, say,
    an fp8 checkpoint's [out, 1] scale, which its weight's dequantization reads). An fp16 matrix stays
    decoded: its 5-bit exponent leaves 3 mantissa bits in the form's 8-bit field, so a tile's
    window of 8 fields spans one binade and most weights escape (a trained-like fp16 matrix: 65 %
    escaped, 1.35 of fp16's bytes; FORMAT.md §6): more memory than fp16, and a matmul patching most weights."""
    return _float_matrix(e) and e.torch_dtype == torch.bfloat16 and e.name.endswith(".weight")


def passed_over(entries) -> list:
    """The decoder layers' float-coded weight matrices this form leaves decoded (`keeps`): fp16 and
    fp32 (float8 ones are an fp8 checkpoint's: fp8.py and fp8_linear.py serve them)."""
    return [e for e in entries if e.layer is not None and _float_matrix(e) and not keeps(e)
            and e.name.endswith(".weight") and e.torch_dtype.itemsize > 1]


def _float_matrix(e) -> bool:
    return e.codec == CODEC_FLOAT and len(e.shape) == 2


def estimate_bytes(kept: list) -> int:
    """Device bytes of the kept tensors (ESCAPES of their weights escaped) and of the temporary
    that the largest unit decodes into for a prompt's rows (`decode_unit_bytes`)."""
    held = sum(form.fixed_nbytes(*e.shape) + form.ESCAPE_NBYTES * int(ESCAPES * e.shape[0] * e.shape[1]) for e in kept)
    return held + decode_unit_bytes(kept)


def decode_unit_bytes(kept: list) -> int:
    """Decoded bytes of the largest matrix a step over fused_limit() rows decodes at once: a layer's
    q, k and v joined, or its gate and up (llama.JOINS, as paged.fuse_projections joins FixedLinears),
    else one tensor. Counting the largest tensor alone left out the joined gate_up's other half (a 7B:
    90 MB of a 180 MB temporary)."""
    units: dict[str, int] = {}
    for e in kept:
        owner, _, attr = e.name.removesuffix(".weight").rpartition(".")      # model.layers.3.mlp, up_proj
        child = owner.rpartition(".")[2]
        unit = next((f"{owner}.{name}" for c, name, parts in llama.JOINS if c == child and attr in parts), e.name)
        units[unit] = units.get(unit, 0) + e.nbytes
    return max(units.values(), default=0)


def permuted_for(modules: tuple, rows: int) -> tuple[int, int]:
    """The x layout (rows, columns: fixedrate.permuted_rows, permuted_cols) in which the step's kernel
    that makes x of `rows` rows may write it for `modules`, every Linear that reads that x: (0, 0)
    (row-major) unless each is a FixedLinear on CUDA, of one in_features, taking the rows fused."""
    if not modules or any(type(m) is not FixedLinear or not m.plane.is_cuda for m in modules) \
            or len({m.in_features for m in modules}) != 1:
        return 0, 0
    permuted = fixedrate.permuted_rows(rows)
    return (permuted, fixedrate.permuted_cols(modules[0].in_features)) if permuted else (0, 0)


class FixedLinear(torch.nn.Module):
    """y = x W^T (+ b), W [out, in] held in the fixed-rate form (its arrays are buffers, so an
    unload's `model.to("meta")` frees them)."""

    def __init__(self, w: fixedrate.FixedRateWeight, bias: torch.nn.Parameter | None):
        super().__init__()
        self.in_features, self.out_features, self.dtype = w.cols, w.rows, w.dtype
        self.hold(w)
        self.bias = bias                         # a Linear's: on meta until the load assigns it

    def hold(self, w: fixedrate.FixedRateWeight) -> None:
        for name, t in zip(fixedrate.ARRAYS, w.arrays):
            self.register_buffer(name, t, persistent=False)

    @staticmethod
    def join(parent: torch.nn.Module, name: str, parts: tuple[FixedLinear, ...]) -> None:
        """paged.fuse_projections for FixedLinears: the parts' forms stacked into one FixedLinear,
        `parent.{name}_linear` (one launch instead of len(parts); the k and v matrices alone fill
        under a wave of an H100), the parts' arrays become row views of it; once."""
        if hasattr(parent, f"{name}_linear") or any(type(p) is not FixedLinear for p in parts) \
                or len({(p.dtype, p.in_features, p.bias is None) for p in parts}) != 1:
            return                               # a part kept decoded (a raw-coded matrix): each alone
        joined = fixedrate.cat_rows([p.weight_form for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        parent.add_module(f"{name}_linear", FixedLinear(joined, bias))
        for p, view in zip(parts, fixedrate.row_views(joined, [p.out_features for p in parts])):
            p.hold(view)

    @property
    def weight_form(self) -> fixedrate.FixedRateWeight:
        return fixedrate.FixedRateWeight(self.out_features, self.in_features, self.dtype,
                                         *(getattr(self, name) for name in fixedrate.ARRAYS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fixedrate.linear(x, self.weight_form)                                       # [..., out]
        return y if self.bias is None else y + self.bias


class HostEmbedding(torch.nn.Module):
    """An embedding table [V, E] in page-locked host memory: ids [...] on the GPU -> [..., E], the
    GPU reading the gathered rows through the table's mapping (ops.gather_host_rows), on the
    current stream with no host sync, so a captured decode step holds it. The table is a CPU
    buffer: an unload's `model.to("meta")` frees it."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", table, persistent=False)
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.numel(), self.embedding_dim, dtype=self.weight.dtype, device=ids.device)   # [N, E]
        ops.gather_host_rows(self.weight, ids.reshape(-1).long(), out)
        return out.view(*ids.shape, self.embedding_dim)


def on_host(w: fixedrate.FixedRateWeight) -> torch.Tensor:
    """The weight decoded into page-locked host memory (its device copy dropped)."""
    table = torch.empty(w.rows, w.cols, dtype=w.dtype, pin_memory=True)
    return table.copy_(fixedrate.decode(w))


def host_table(config: llama.LlamaConfig) -> bool:
    """Whether a llama.py model of `config` keeps its embedding table on the host in this form on
    CUDA: no head shares the table, and the gather op is built."""
    return not config.tie_word_embeddings and ops.has_ops(ops.HOST_ROWS_OPS, "cuda")


def host_names(native: llama.LlamaConfig | None) -> frozenset[str]:
    """The tensors this form keeps on the host for a model whose config.json is parsed as `native`
    (llama.native_config; None: not llama.py's) -- the memory budget's estimate, before the
    load: an untied llama.py model's embedding table."""
    return frozenset({EMBEDDING}) if native is not None and host_table(native) else frozenset()


def _table_on_host(model: torch.nn.Module, name: str, w: fixedrate.FixedRateWeight) -> bool:
    return name == EMBEDDING and w.plane.is_cuda and isinstance(model, llama.LlamaForCausalLM) \
        and host_table(model.config)


def attach(model: torch.nn.Module, kept: dict[str, fixedrate.FixedRateWeight]) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Put FixedLinears in place of the Linears whose weights were `kept` (in `model`, still on
    meta), and a HostEmbedding in place of an embedding that no head shares. Returns the
    FixedLinears' device bytes, the host table's bytes and, decoded back on the device, the kept
    tensors that are neither (a tied embedding: the head shares it, as in decoded mode)."""
    held, host, rest = 0, 0, {}
    for name, w in kept.items():
        owner, attr = llama.owner_of(model, name.removesuffix(".weight"))
        module = getattr(owner, attr, None)
        if name.endswith(".weight") and type(module) is llama.Linear:
            setattr(owner, attr, FixedLinear(w, module.bias))
            held += w.nbytes
        elif _table_on_host(model, name, w):
            model.model.embed_tokens = HostEmbedding(on_host(w))
            host += model.model.embed_tokens.weight.nbytes
        else:
            rest[name] = fixedrate.decode(w)
    return held, host, rest
