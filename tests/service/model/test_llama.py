"""service/model/llama.py and service/model/tokenizer.py against transformers: same logits, same tokens, same
chat prompt; anything they do not implement exactly is left to transformers (parse -> None)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from codec.decode import Archive
from service.model import llama
from service.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[3]


def _pair(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rope_theta=5000.0, **overrides)
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(hf_config).eval()
    ours = llama.LlamaForCausalLM(llama.LlamaConfig.parse(json.loads(hf_config.to_json_string())), device="meta")
    ours.load_state_dict(theirs.state_dict(), assign=True, strict=False)
    ours.tie_weights()
    ours.model.rotary_emb = llama.Rotary(ours.config)
    return theirs, ours.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_with_padding_and_a_cache(tied: bool) -> None:
    theirs, ours = _pair(tie_word_embeddings=tied)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 3, 4, 5, 6]])                    # [B, S], row 1 left-padded
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = theirs(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        b = ours(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        torch.testing.assert_close(b.logits[0], a.logits[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b.logits[1, 2:], a.logits[1, 2:], rtol=0, atol=1e-5)
        step = torch.tensor([[1], [2]])
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        a = theirs(input_ids=step, attention_mask=mask, position_ids=pos[:, -1:] + 1,
                   past_key_values=a.past_key_values, use_cache=True, logits_to_keep=1)
        b = ours(input_ids=step, attention_mask=mask, position_ids=pos[:, -1:] + 1,
                 past_key_values=b.past_key_values, use_cache=True, logits_to_keep=1)
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-5)
    b.past_key_values.batch_select_indices(torch.tensor([1]))
    assert b.past_key_values.get_seq_length() == 7 and b.past_key_values.layers[0].keys.shape[0] == 1


def test_llama3_rope_matches_transformers() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    theirs, ours = _pair(rope_scaling=rope)
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq, rtol=0, atol=0)



@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_attention_is_sdpa_on_repeated_kv(q_len: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    b, heads, kv, t, d = 3, 6, 2, 11, 16
    q = torch.randn(b, heads, q_len, d, dtype=dtype)                                # [B, H, S, D]
    k, v = torch.randn(b, kv, t, d, dtype=dtype), torch.randn(b, kv, t, d, dtype=dtype)
    real = (torch.arange(t) >= torch.tensor([[0], [4], [7]])).long()                # [B, T], left padding
    mask = llama.causal_mask(real, q_len)                                           # [B, 1, S, T]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(llama.grouped_attention(q, k, v, mask, 0.25), want)   # summation order only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotation_by_roll_and_signed_sin_is_rotate_half_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=dtype).transpose(1, 2)                        # a strided view, as in _attend
    cos, sin = torch.randn(2, 1, 3, 8, dtype=dtype), torch.randn(2, 1, 3, 8, dtype=dtype)
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)                    # transformers' rotation
    want = x * cos + rotate_half * sin
    assert torch.equal(x * cos + x.roll(4, -1) * llama._signed_sin(sin), want)


@pytest.mark.parametrize("change", [{"model_type": "gemma"}, {"hidden_act": "gelu"},
                                    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
                                     "num_hidden_layers": 2, "max_window_layers": 1},      # a window on layer 1 only
                                    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}])
def test_what_is_not_implemented_goes_to_transformers(change: dict) -> None:
    base = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": None}   # Mistral v0.2+: no window
    assert llama.LlamaConfig.parse(base) is not None
    assert llama.LlamaConfig.parse({**base, **change}) is None


@pytest.mark.parametrize(("window", "positions", "context", "takes_effect"), [
    (4096, 32768, None, True),             # Mistral-7B-v0.1, its whole context served: the window hides keys
    (4096, 32768, 4096, False),            # WCODEC_MAX_TOTAL_TOKENS=4096: a query at 4095 sees key 0
    (4096, 32768, 4097, True),             # one more: a query at 4096 does not
    (4096, 32768, 2048, False),            # the service's default limit
    (32768, 32768, None, False),           # a window as long as the positions
    (32767, 32768, 65536, True)])          # a limit above the positions: the positions bound a sequence
def test_a_window_no_sequence_served_outgrows_is_no_window(window: int, positions: int, context: int | None,
                                                           takes_effect: bool) -> None:
    """A window is no window (full attention) where it can never take effect: no sequence is
    longer than it, the model's positions or the service's context limit bounding it
    (inference._within_context: min(WCODEC_MAX_TOTAL_TOKENS, positions)). transformers' query at
    position p sees the keys at positions > p - window: all of them while p < window."""
    d = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
         "num_attention_heads": 2, "sliding_window": window, "max_position_embeddings": positions}
    served = window if takes_effect else None
    assert llama.LlamaConfig.parse(d, context).sliding_window == served
    qwen = {**d, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0}
    assert llama.LlamaConfig.parse(qwen, context).sliding_window == served
    some_layers = llama.LlamaConfig.parse({**qwen, "max_window_layers": 1}, context)     # transformers' classes
    assert (some_layers is None) == takes_effect


@pytest.mark.parametrize("window", [0, -1, 4.5, "4096"])
def test_a_window_that_is_not_a_positive_integer_fails_the_load_typed(window) -> None:
    from service.errors import LoadFailed
    from service.model import build
    config = {"model_type": "mistral", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": window}
    with pytest.raises(LoadFailed, match="config.json is not valid: ValueError: sliding_window must be a positive"):
        build.prepare("m", {"config.json": json.dumps(config).encode()})


def test_tokenizer_matches_transformers(demo_archive: Path) -> None:
    from transformers import AutoTokenizer
    with Archive.open(demo_archive) as archive:
        files = archive.reader.files()
    ours = Tokenizer.from_files(files)
    with tempfile.TemporaryDirectory() as tmp:
        for name, blob in files.items():
            (Path(tmp) / name).write_bytes(blob)
        theirs = AutoTokenizer.from_pretrained(tmp)
    assert ours.all_special_ids == theirs.all_special_ids and len(ours) == len(theirs)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == \
        (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id)
    text = "<|im_start|>user\nWhat's the capital of France? Héllo wörld  , ok .<|im_end|>\n"
    for special in (True, False):
        assert ours(text, add_special_tokens=special)["input_ids"] == theirs(text, add_special_tokens=special)["input_ids"]
    mine, want = ours(text, return_offsets_mapping=True), theirs(text, return_offsets_mapping=True)
    assert mine["input_ids"] == want["input_ids"] and mine["offset_mapping"] == want["offset_mapping"]   # /tokenize's
    ids = theirs(text)["input_ids"] + [2, 0, 1]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == \
            theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


def test_decoding_and_streaming_ignore_clean_up_tokenization_spaces(demo_archive: Path) -> None:
    """TGI decodes with the tokenizers library, which never "cleans up" spaces (Llama-3's config
    sets the flag; transformers 5 ignores it for BPE): text stays as written, and the streamed
    pieces join to it (the clean-up lost characters between pieces: "it 's fine" -> "it ' fine")."""
    import json

    from service.engine.sampling import Detokenizer
    with Archive.open(demo_archive) as archive:
        files = archive.reader.files()
    config = json.loads(files["tokenizer_config.json"])
    tok = Tokenizer.from_files({**files, "tokenizer_config.json": json.dumps(
        {**config, "clean_up_tokenization_spaces": True}).encode()})
    for text in ("x = 1 , y = 2", "it 's fine", "Use the ' key", "Hello . World"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        pieces = Detokenizer(tok.decode)
        assert "".join(pieces.add(i) for i in ids) == text


def test_a_tokenizer_is_kept_by_the_content_of_its_files(demo_archive: Path) -> None:
    with Archive.open(demo_archive) as archive:
        files = archive.reader.files()
    first = Tokenizer.from_files(files)
    assert Tokenizer.from_files(dict(files)) is first                      # a switch back: not parsed again
    template = files["chat_template.jinja"] if "chat_template.jinja" in files else b""
    other = Tokenizer.from_files({**files, "chat_template.jinja": template + b"{# another #}"})
    assert other is not first and other.chat_template.endswith("{# another #}")
    assert Tokenizer.from_files({k: v for k, v in files.items() if k != "tokenizer.json"}) is None


def test_serving_the_demo_imports_neither_transformers_nor_dynamo(demo_archive: Path) -> None:
    """The forward pass's modules only: a fresh process prepares, decodes and runs the demo model,
    once directly and once through the engine's KV cache."""
    code = f"""
import sys, torch
from codec.decode import Archive
from service.load import pipeline
from service.model import build
from service.engine import Engine
from service.engine.kv import PaddedKV, cache_class, forward_all
with Archive.open({str(demo_archive)!r}) as a:
    opened = a.entries, a.reader.files()
prepared = build.prepare("demo", opened[1])
decoded = pipeline.decode_archive({str(demo_archive)!r}, torch.device("cpu"), opened=opened)
served = build.finish("demo", prepared, decoded.tensors, decoded.layers, torch.device("cpu"))
ids = served.tokenizer.apply_chat_template([{{"role": "user", "content": "What is the capital of France?"}}],
                                           add_generation_prompt=True, tokenize=True)
with torch.inference_mode():
    token = int(served.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax())
    kv = PaddedKV(torch.device("cpu"), cache_class(served.model), rows=1)
    assert int(forward_all(served.model, [(kv, torch.tensor([ids]), torch.ones(1, len(ids)))])[0][0].argmax()) == token
print(served.tokenizer.decode([token]), sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "sympy")
      or m.startswith("torch._dynamo")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The []"


@pytest.mark.parametrize("change", [{"num_attention_heads": 0}, {"vocab_size": None}, {"hidden_size": "8"}])
def test_a_config_that_is_not_valid_fails_the_load_typed(change: dict) -> None:
    """0 heads (a division by zero in the head size), a missing or mistyped field: LoadFailed,
    whose message names config.json (an HTTP 4xx/5xx with TGI's error shape, not a crash)."""
    from service.errors import LoadFailed
    from service.model import build
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    config = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(LoadFailed, match="config.json is not valid"):
        build.prepare("m", {"config.json": json.dumps(config).encode()})


@pytest.mark.parametrize("extra", [{"model_type": "llama"}, {"model_type": "mistral"}, {"model_type": "qwen2"},
                                   {"model_type": "qwen2", "use_sliding_window": True},
                                   {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0},
                                   {"model_type": "qwen2", "use_sliding_window": True,
                                    "layer_types": ["sliding_attention"]},
                                   {"model_type": "mistral", "sliding_window": None},
                                   {"model_type": "llama", "sliding_window": 16}, {"model_type": "qwen3"},
                                   {"model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 0}])
def test_a_field_config_json_omits_is_read_as_transformers_reads_it(tmp_path: Path, extra: dict) -> None:
    """A config.json without `sliding_window` or `max_position_embeddings` (hand-written, or cut to
    what differs): transformers' class defaults apply (Mistral: a 4096-token window, 131072
    positions; Qwen2: 32768, a 4096 window once switched on, on the layers from max_window_layers
    (28) on, so on none of 1 layer; Qwen3 as Qwen2, and a head_dim of 128 whatever hidden_size and
    the heads are, Qwen3-0.6B's). llama.py served such a Mistral with full attention, as no
    window, and every type with 2048 positions."""
    from transformers import AutoConfig
    d = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, **extra}
    (tmp_path / "config.json").write_text(json.dumps(d))
    theirs, ours = AutoConfig.from_pretrained(tmp_path), llama.LlamaConfig.parse(d)
    layers = getattr(theirs, "layer_types", None) or ["sliding_attention"]   # Mistral: every layer
    windowed = theirs.model_type != "llama" and getattr(theirs, "sliding_window", None) is not None \
        and "sliding_attention" in layers                                   # LlamaAttention reads no window
    assert ours.sliding_window == (theirs.sliding_window if windowed else None)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
