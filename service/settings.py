"""The service's one settings object: every knob is an environment variable `WCODEC_<NAME>`."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from .load.names import NAME_PATTERN


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WCODEC_", extra="ignore", populate_by_name=True)

    # where models live: one `<name>.wcodec` file per model
    model_store: Path = Path("models")
    default_model: str | None = Field(None, pattern=NAME_PATTERN)    # the model of requests that name none
    device: str | None = Field(None, pattern=r"^(cpu|cuda(:\d+)?)$")  # default: cuda when there is a GPU
    gpu_memory_budget: int | None = Field(None, ge=0)    # bytes; on CPU: decoded bytes resident
    admin_token: SecretStr | None = None         # bearer token for load/unload; None: open

    # start-up: build the demo model into an empty store, then load `preload`
    demo: bool = True
    preload: list[str] | None = None             # None: the demo model, when the store holds it
    demo_workers: int | None = Field(None, ge=1)

    # loading pipeline
    load_ring_buffers: int = Field(4, ge=2)      # host buffers between the reader and the decoder
    verify_crc: bool = True                      # every stored stream's checksum (XXH3-64, else CRC32)
    load_read_threads: int | None = Field(None, ge=1)    # reads in flight; default min(16, 2 x CPUs)
    load_direct_io: str = Field("auto", pattern="^(auto|off)$")   # auto: O_DIRECT for bytes not in the page cache
    early_read: bool = True                      # `wcodec serve` reads preloaded archives from its first instant
    # compressed archives kept in host memory after their load (pinned on CUDA), so that a model
    # switch reads no file (service/load/hostcache.py); None: a quarter of the available memory; 0: off
    host_cache_bytes: int | None = Field(None, ge=0)
    # how a loaded model's decoder layers are held on the device (docs/RESIDENT.md): "decoded" bf16,
    # or "compressed" (each module's weights decoded into a ring of `compressed_scratch` scratch
    # buffers just before use). WCODEC_RESIDENT / WCODEC_RESIDENT_SLOTS: the old names, kept as
    # aliases for one release
    weights: Literal["decoded", "compressed"] = Field(
        "decoded", validation_alias=AliasChoices("WCODEC_WEIGHTS", "WCODEC_RESIDENT"))
    # the form compressed weights take on CUDA (docs/RESIDENT.md): "fixed" (the fixed-rate form,
    # multiplied by the fused decode-matmul: fixed.py) or "indexed" (the archive's rANS streams and
    # their index, decoded a module ahead on a side stream: compressed.py; the CPU's form)
    compressed_form: Literal["fixed", "indexed"] = "fixed"
    compressed_scratch: int = Field(      # CUDA; the CPU decodes in place with one
        2, ge=1, validation_alias=AliasChoices("WCODEC_COMPRESSED_SCRATCH", "WCODEC_RESIDENT_SLOTS"))

    @classmethod
    def env_name(cls, loc: tuple) -> str:
        """The environment variable a validation error's `loc` is about: the name that is set (a
        field's old name, kept as an alias, included), else WCODEC_<FIELD>."""
        import os
        name = ".".join(map(str, loc)).upper()
        for field in cls.model_fields.values():
            choices = getattr(field.validation_alias, "choices", ())
            if name in choices:
                return next((c for c in choices if c in os.environ), name)
        return name if name.startswith("WCODEC_") else f"WCODEC_{name}"

    def read_threads(self) -> int:
        import os
        return self.load_read_threads or min(16, 2 * (os.cpu_count() or 1))

    def direct_io(self) -> bool | None:
        return None if self.load_direct_io == "auto" else False

    def host_cache_budget(self) -> int:
        from .load.memory import available_memory
        return available_memory() // 4 if self.host_cache_bytes is None else self.host_cache_bytes

    def torch_device(self):
        """Where models are decoded and run: WCODEC_DEVICE, else CUDA when there is a GPU. torch is
        imported here, not at this module's import: `wcodec serve` reads its settings before it."""
        import torch
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    # generation
    max_batch_size: int = Field(64, ge=1)        # rows in a model's running batch
    max_batch_tokens: int = Field(512, ge=1)     # tokens one step feeds the model: a token per running
                                                 # row, the rest for prompts (chunked beyond it)
    max_queue: int = Field(64, ge=1)             # waiting requests per model before 429
    batch_wait_ms: float = Field(2.0, ge=0)      # how long an idle engine waits for a burst to arrive
    cpu_dtype: Literal["auto", "model", "float32"] = "auto"   # CPU compute dtype (service/model/cpu_dtype.py)
    # llama.py's models: "paged" KV cache, CUDA graphs (service/engine/scheduler.py); "padded": the
    # engine before it (service/engine/batcher.py, which serves transformers' models either way);
    # "auto": paged (the two engines' figures: docs/BENCHMARKS.md)
    engine: Literal["auto", "paged", "padded"] = "auto"
    kv_block_size: int = Field(16, ge=1)         # tokens a KV cache block
    kv_cache_bytes: int | None = Field(None, ge=0)   # the KV cache; None: kv_cache_fraction (CUDA), 1 GiB (CPU)
    kv_cache_fraction: float = Field(0.5, gt=0, le=1)    # of the device memory free after the weights
    prefix_caching: bool = True                  # a prompt's known prefix read from the KV cache (blocks.py)
    cuda_graphs: bool = True                     # decode steps replayed as CUDA graphs (decoded weights)
    prefill_wait_ms: float = Field(20.0, ge=0)   # with graphs: gather arrivals this long into one prefill
    prompt_graph_rows: int | None = Field(None, ge=0)   # with graphs: steps of short prompts up to this many
                                                 # rows replayed too (None: max_batch_tokens; at most 512)
    payload_limit: int = Field(2_000_000, ge=1)  # request body bytes before 413 (TGI's --payload-limit)
    # TGI's launcher limits, at its defaults (--max-best-of, --max-stop-sequences, --max-top-n-tokens):
    # the TGI routes refuse more in its router's words, /info reports them
    max_best_of: int = Field(2, ge=1)
    max_stop_sequences: int = Field(4, ge=0)
    max_top_n_tokens: int = Field(5, ge=0)
    max_input_tokens: int = Field(1024, ge=1)
    max_total_tokens: int = Field(2048, ge=2)
    default_max_new_tokens: int = Field(100, ge=1)
    retry_after_s: int = Field(5, ge=1)          # Retry-After on 503 while a model is not ready
    grammar_compile_s: float = Field(120.0, gt=0)    # building one grammar's index (a child process), then 422
    grammar_compile_bytes: int = Field(8 << 30, ge=1 << 28)   # that process's address space

    # `wcodec serve`
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: str = Field("info", pattern="(?i)^(critical|error|warning|info|debug)$")
