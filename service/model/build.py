"""A servable model from decoded tensors, gpt-fast style: the model is built on the `meta` device
from the archive's embedded config and the decoded tensors are assigned as its parameters
(`load_state_dict(assign=True)`), so the weights exist once, where they were decoded.

Only what the forward pass needs is imported: Llama-family models (llama.py) and generic fast
tokenizers (tokenizer.py) never import transformers; other architectures
and tokenizers use transformers' Auto classes, imported on first use.

Non-persistent buffers (rotary `inv_freq`) are not in a checkpoint: the modules that hold them
are rebuilt on the target device. Tied heads (`lm_head` = embeddings) are re-tied."""
from __future__ import annotations

import itertools
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import torch

from cuda_ext import fixedrate, quant

from ..errors import LoadFailed
from ..timeline import Timeline
from . import compressed, fixed, fp8, fp8_linear, llama, quantized
from .defaults import sampling_defaults
from .token_bytes import TokenBytes
from .tokenizer import Tokenizer


@dataclass
class ServedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object               # service.model.tokenizer.Tokenizer or a transformers PreTrainedTokenizerFast
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int]
    pad_id: int
    max_positions: int
    weight_bytes: int               # device bytes of its weights as they are held (`weights`)
    weights: str = "decoded"        # "compressed": decoder layers decoded per forward (compressed.py)
    schedule: compressed.UnitSchedule | None = None     # in compressed mode
    host_bytes: int = 0             # host bytes of its weights (fixed.HostEmbedding's table)
    sampling_defaults: dict[str, float] = field(default_factory=dict)   # its generation_config's (defaults.py)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids decode(skip_special_tokens=True) drops, so that streamed text (pieces of the
        other ids) is the text of the answer not streamed: the special tokens, and every added
        token marked special (SmolLM2's <file_sep>, <repo_name>, ...)."""
        tok = self.tokenizer
        added = getattr(tok, "added_tokens_decoder", {})
        return frozenset(tok.all_special_ids) | {i for i, t in added.items() if t.special}

    @cached_property
    def longest_token(self) -> int:
        """The most characters a token stands for: its vocabulary entry's length (a byte-level
        entry spells one character per byte, so never fewer); 0 where no Rust tokenizer says."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return max(map(len, backend.get_vocab(with_added_tokens=True)), default=0) if backend else 0

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """`token_bytes(id)`: the bytes a token stands for, a piece of a character included (OpenAI's
        logprobs)."""
        return TokenBytes(self.tokenizer)

    def release(self) -> None:
        """Give the weights back now (an unload): a request still unwinding may hold this object,
        so it keeps a skeleton on meta; compressed mode's hooks, scratch and kept streams go too."""
        self.model.to("meta")
        if self.schedule is not None:
            self.schedule.remove()
            self.schedule = None


def _write_files(files: dict[str, bytes], folder: Path) -> None:
    for name, blob in files.items():
        if Path(name).name != name or name.startswith("."):
            raise LoadFailed(f"embedded file name {name!r} is not a plain file name")
        (folder / name).write_bytes(blob)


def _rebuild_meta_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    """Re-create, on `device`, every module whose own buffers are still on meta (rotary tables)."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        try:
            with torch.device(device):
                fresh = type(module)(config=config)
        except TypeError as e:
            _init_buffers(model, name, module, device, e)
            continue
        setattr(*llama.owner_of(model, name), fresh)


def _init_buffers(model: torch.nn.Module, name: str, module: torch.nn.Module, device: torch.device,
                  why: Exception) -> None:
    """The meta buffers of a module not built from the config alone (Gemma's scaled embedding and
    its `embed_scale`) set as transformers' from_pretrained sets them: by the model's
    `_init_weights`, whose `init` functions leave a tensor marked `_is_hf_initialized` alone (the
    module's assigned weights). A buffer it leaves unset (NaN) fails the load, never served."""
    buffers = {k: b for k, b in module.named_buffers(recurse=False) if b.is_meta}
    init = getattr(model, "_init_weights", None)
    if init is None or not all(b.is_floating_point() for b in buffers.values()):
        raise LoadFailed(f"cannot rebuild {name} ({type(module).__name__}): {why}")
    for p in module.parameters(recurse=False):
        p._is_hf_initialized = True
    for k, b in buffers.items():
        setattr(module, k, torch.full(b.shape, float("nan"), dtype=b.dtype, device=device))
    init(module)
    unset = [k for k in buffers if getattr(module, k).isnan().any()]
    if unset:
        raise LoadFailed(f"cannot rebuild {name} ({type(module).__name__}): its buffers {unset} are not set by "
                         f"{type(model).__name__}._init_weights ({why})")


_IMPORT_LOCK = threading.Lock()


def hf(*names: str) -> tuple:
    """transformers classes by name. Its lazy module is not thread-safe: two threads importing
    different names at once can fail, and loads prepare on a thread beside the start-up warm-up."""
    with _IMPORT_LOCK:
        import transformers
        return tuple(getattr(transformers, n) for n in names)


def skeleton(config) -> torch.nn.Module:
    """The causal LM of `config` on the meta device: structure only, no memory."""
    (auto_lm,) = hf("AutoModelForCausalLM")
    with torch.device("meta"):
        return auto_lm.from_config(config)


def assemble(config, tensors: dict[str, torch.Tensor], device: torch.device,
             model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The causal LM of `config` with `tensors` as its weights; no tensor is copied."""
    model = model if model is not None else skeleton(config)
    result = model.load_state_dict(tensors, assign=True, strict=False)
    if result.unexpected_keys:
        raise LoadFailed(f"tensors unknown to {config.model_type}: {result.unexpected_keys[:5]}")
    model.tie_weights()
    _rebuild_meta_buffers(model, config, device)
    missing = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if missing:
        raise LoadFailed(f"the archive lacks tensors: {missing[:5]}")
    return model.eval().requires_grad_(False)


def _eos_ids(config, generation, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(generation, "eos_token_id", None), config.eos_token_id, tokenizer.eos_token_id):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(ids)


@dataclass
class Prepared:
    """What a model needs besides its weights; built while the weights decode."""

    config: object
    tokenizer: object
    generation: object | None
    model: torch.nn.Module          # on meta until finish() assigns the decoded tensors
    seconds: float
    defaults: dict[str, float] = field(default_factory=dict)       # sampling defaults (defaults.py)


def _hf_prepare(files: dict[str, bytes], tokenizer: object | None) -> tuple[object, object, object | None]:
    """Config, tokenizer and generation config through transformers' Auto classes."""
    AutoConfig, AutoTokenizer, GenerationConfig = hf("AutoConfig", "AutoTokenizer", "GenerationConfig")  # noqa: N806
    with tempfile.TemporaryDirectory(prefix="wcodec-") as tmp:
        _write_files(files, Path(tmp))
        config = AutoConfig.from_pretrained(tmp)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(tmp)
        has_generation = (Path(tmp) / "generation_config.json").exists()
        generation = GenerationConfig.from_pretrained(tmp) if has_generation else None
    return config, tokenizer, generation


def prepare(name: str, files: dict[str, bytes], context: int | None = None) -> Prepared:
    """Config, tokenizer, generation config and the meta-device skeleton from embedded files;
    `context`: the longest sequence served (WCODEC_MAX_TOTAL_TOKENS; llama.LlamaConfig.parse)."""
    t0 = time.perf_counter()
    if "config.json" not in files:
        raise LoadFailed(f"model {name!r} embeds no config.json: it cannot be served")
    files = fp8.unquantized_files(files)
    try:
        native = llama.LlamaConfig.parse(json.loads(files["config.json"]), context)
    except llama.INVALID_CONFIG as e:
        raise LoadFailed(f"model {name!r}: config.json is not valid: {type(e).__name__}: {e}") from None
    tokenizer = Tokenizer.from_files(files)
    defaults = sampling_defaults(name, files.get("generation_config.json"))
    if native is None:
        config, tokenizer, generation = _hf_prepare(files, tokenizer)
        return Prepared(config, tokenizer, generation, skeleton(config), time.perf_counter() - t0, defaults)
    if tokenizer is None:
        (auto_tokenizer,) = hf("AutoTokenizer")
        with tempfile.TemporaryDirectory(prefix="wcodec-") as tmp:
            _write_files(files, Path(tmp))
            tokenizer = auto_tokenizer.from_pretrained(tmp)
    blob = files.get("generation_config.json")
    generation = SimpleNamespace(**json.loads(blob)) if blob else None
    model = llama.LlamaForCausalLM(native, device="meta")
    return Prepared(native, tokenizer, generation, model, time.perf_counter() - t0, defaults)


def finish(name: str, prepared: Prepared, decoded: dict[str, torch.Tensor], kept: list[compressed.CompressedLayer],
           device: torch.device, scratch: int = 2, on_forward=None,
           blocks: dict[str, quant.QuantBlocks] | None = None,
           fixed_form: dict[str, fixedrate.FixedRateWeight] | None = None,
           fp8_kept: dict[str, fp8_linear.Fp8Weight] | None = None) -> ServedModel:
    """Assign the `decoded` tensors. Layers the loader `kept` compressed get a decode schedule
    (`scratch` buffers on CUDA); GGUF tensors kept as `blocks`, block modules (quantized.py; a
    model that is not llama.py's gets them dequantized instead, held and counted as decoded
    tensors); matrices in the fixed-rate form (`fixed_form`), FixedLinears (fixed.py); fp8 matrices
    kept as their e4m3 bytes (`fp8_kept`), Fp8Linears (fp8_linear.py; dequantized where no
    llama.py Linear takes them)."""
    config, tokenizer = prepared.config, prepared.tokenizer
    tensors, schedule, held, host = decoded, None, 0, 0
    if blocks and not isinstance(prepared.model, llama.LlamaForCausalLM):
        tensors = decoded = {**decoded, **quantized.dequantized(blocks)}
        blocks = None
    if blocks:
        held = quantized.attach(prepared.model, blocks, device)
    if fixed_form:
        held_fixed, host, back = fixed.attach(prepared.model, fixed_form)
        tensors, decoded, held = {**tensors, **back}, {**decoded, **back}, held + held_fixed
    if fp8_kept:
        held_fp8, back = fp8_linear.attach(prepared.model, fp8_kept)
        tensors, decoded, held = {**tensors, **back}, {**decoded, **back}, held + held_fp8
    if kept:
        schedule = compressed.attach(prepared.model, kept, device, scratch, on_forward)
        tensors = {**tensors, **schedule.placeholders()}
    model = assemble(config, tensors, device, prepared.model)
    weight_bytes = sum(t.nbytes for t in decoded.values()) + held
    if schedule is not None:
        schedule.install()
        weight_bytes += schedule.compressed_bytes + schedule.scratch_bytes
    eos = _eos_ids(config, prepared.generation, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    dtype = next(iter(blocks.values())).dtype if blocks else next(model.parameters()).dtype
    return ServedModel(name, model, tokenizer, device, dtype, eos, pad,
                       getattr(config, "max_position_embeddings", 2048), weight_bytes,
                       "compressed" if schedule is not None or blocks or fixed_form or fp8_kept else "decoded", schedule, host,
                       prepared.defaults)


_WARM_LOCK = threading.Lock()
_WARMED: set[str] = set()                  # device types warmed up in this process


def warm_up(device: torch.device, timeline: Timeline | None = None) -> None:
    """One-time costs paid at start-up, not at the first load: the decoder extension and the CUDA
    context. `wcodec serve` starts this on a thread right after torch's import; the lifespan calls
    it again, which waits for that one and then returns."""
    timeline = timeline or Timeline()
    with _WARM_LOCK:
        if device.type in _WARMED:
            return
        with timeline.span("warm-up: import cuda_ext (decoder extension)"):
            import cuda_ext
            cuda_ext.available()
        if device.type == "cuda":
            with timeline.span("warm-up: CUDA context"):
                torch.empty(1, device=device)
        _WARMED.add(device.type)


def first_kernels(device: torch.device, dtype: torch.dtype, timeline: Timeline) -> None:
    """Run the kernels a forward of `dtype` uses once, at toy sizes (the paged engine's eager step
    on a toy model: its matmuls, SiLU, masked SDPA, norms, rotary, cache writes), so that cuBLAS's
    handle and the kernels' modules are loaded before the first request: the first token came
    ~0.9 s after /health/ready without it (H100 box, 7B-shaped, page cache warm). An early load
    runs it on a thread that nothing waits for: with the page cache dropped it read the kernels
    from the disk for 4.8 s, which must not hold a load back."""
    from . import paged
    with timeline.span(f"warm-up: cuBLAS and attention kernels ({dtype})"):
        paged.warm_up(device, dtype)                # synchronizes
