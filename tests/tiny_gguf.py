"""A tiny random Qwen2 written as a GGUF the way llama.cpp's convert_hf_to_gguf.py writes Qwen2 and
Qwen2.5 (arch "qwen2": `qwen2.*` metadata, q/k/v biases in F32, no q/k row permutation, a `gpt2`
tokenizer with pre-tokenizer "qwen2", the vocabulary padded with [PADn] up to the embedding's rows),
its matrices as Q8_0 and Q4_K blocks. Import as `from tests.tiny_gguf import ...`.

The reference a test compares with is transformers' Qwen2ForCausalLM holding what the `gguf`
package dequantizes from the written file (`dequantized_state`), not the random model's weights."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

# transformers' models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX (Qwen2's tokenizer.json)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = ("What is the capital of France? The capital of France is Paris.", "I'll say it's 2024, 12345 cats.",
          "日本語のテキスト 東京\n\n1. one\n2. two", "don't   won't\tthey're")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6)
GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Q4_K_M-like: Q4_K where a row is whole super-blocks of 256, Q8_0 for v, down and the tables
Q8_0 = ("attn_v", "ffn_down", "token_embd", "output")


def qwen2_tokenizer():
    """A Qwen2-style byte-level BPE built by `tokenizers` as Qwen2's tokenizer.json is: NFC, the
    Qwen2 split isolated, ByteLevel without its own regex, the specials after the merged tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(CORPUS) * 20, trainer)
    tok.add_special_tokens(list(SPECIALS))
    return tok


def random_qwen2(vocab: int, tied: bool, seed: int = 0):
    """transformers' Qwen2ForCausalLM (fp32, 2 layers), biases and norms moved off their 0 / 1 init."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, tie_word_embeddings=tied, use_sliding_window=False, **SIZES)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def gguf_name(hf: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{GGUF_LAYER[rest]}.{suffix}"
    return f"{GGUF_TOP[stem]}.{suffix}"


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols % 256 == 0) -> Q4_K blocks uint8 [rows, cols / 256 * 144]: per
    sub-block of 32, y = d * sc * q - dmin * m (ggml-common.h block_q4_K; gguf has no Q4_K quantizer)."""
    x = w.astype(np.float32).reshape(-1, 8, 32)                       # [super-blocks, sub-blocks, weights]
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, mins = (hi - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / np.maximum(dmin.astype(np.float32), 1e-30)[:, None]), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint((x + offset) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    scales = np.empty((len(x), 12), dtype=np.uint8)                   # get_scale_min_k4's 6-bit packing
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(x), 128)       # bytes of chunk c: sub 2c low, 2c+1 high
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)
    return blocks.reshape(w.shape[0], -1)


def _quantized(name: str, w: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    if w.ndim != 2:
        return w, None                                                 # norms and biases: F32, as llama.cpp keeps them
    if name.split(".")[-2] in Q8_0 or w.shape[1] % 256:
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return quantize_q4_k(w), gguf.GGMLQuantizationType.Q4_K


def _write_tokenizer(writer: gguf.GGUFWriter, tok, rows: int, eot: str | None) -> None:
    import json
    model = json.loads(tok.to_str())["model"]
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), rows)]        # convert_hf_to_gguf pads to the embedding
    types += [gguf.TokenType.UNUSED] * (rows - len(types))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
    writer.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    writer.add_pad_token_id(tok.token_to_id("<|endoftext|>"))
    if eot is not None:
        writer.add_eot_token_id(tok.token_to_id(eot))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)


def write_qwen2_gguf(path: Path, model, tok, arch: str = "qwen2", eot: str | None = None) -> Path:
    """`model` (a Qwen2ForCausalLM) and `tok` as llama.cpp writes them (`arch` other than qwen2:
    the same file under another name, for the refusals; `eot`: a token named by
    `tokenizer.ggml.eot_token_id`)."""
    c = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny-qwen2")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(SIZES["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _write_tokenizer(writer, tok, c.vocab_size, eot)
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue                                                   # a tied head is not written
        data, qtype = _quantized(gguf_name(hf), t.detach().float().numpy())
        writer.add_tensor(gguf_name(hf), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_state(path: Path) -> dict[str, torch.Tensor]:
    """{GGUF name: float32 tensor in torch's layout}, dequantized by the `gguf` package."""
    reader = gguf.GGUFReader(path)
    return {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
                    .reshape(tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}


def reference_model(path: Path, model):
    """transformers' Qwen2ForCausalLM of `model`'s config holding the file's dequantized weights."""
    from transformers import Qwen2ForCausalLM

    reference = Qwen2ForCausalLM(model.config).eval()
    by_gguf = dequantized_state(path)
    state = {hf: by_gguf[gguf_name(hf)] for hf in reference.state_dict()
             if not (hf == "lm_head.weight" and model.config.tie_word_embeddings)}
    reference.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    reference.tie_weights()
    return reference
