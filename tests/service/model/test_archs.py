"""Every architecture the server accepts, against transformers on the same weights: a tiny random
model of transformers' own config class, saved as an HF folder, compressed (`codec.encode.compress`),
loaded through the server's path (build.prepare, the load pipeline, build.finish) and run as the
engine runs it (the padded batcher's KV cache, service/engine/kv.py; llama.py's models also through
the paged engine, batched rows and chunked prompts). fp32 on the CPU: logits within 1e-5, the same
greedy tokens. llama.py serves llama, mistral, qwen2 and qwen3 (LlamaConfig.parse), sliding windows on
every layer (prompts of 40 tokens and the paged engine's 46: past windows of 8 and 16, in prefill
and decode) and windows that never hide a key (as long as the positions, or on no layer); the
others and Qwen2's and Qwen3's windows on some layers go to transformers' classes, and must compute
what transformers computes. Qwen3's per-head q_norm and k_norm are perturbed off their 1 init, as
the other norms are, in models of head_dim 32 and 24 (not hidden / heads = 16, as Qwen3-0.6B's 128
is not 1024 / 16)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codec.decode import Archive
from codec.encode import compress
from service.engine.kv import PaddedKV, cache_class, forward_all
from service.load import pipeline
from service.model import build, llama

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}       # the prompts run past it
CASES = {
    "llama-gqa-tied": ("Llama", dict(tie_word_embeddings=True)),
    "llama-head-dim-24-biases": ("Llama", dict(head_dim=24, attention_bias=True, mlp_bias=True)),
    "llama-linear-theta": ("Llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=5e5)),
    "llama-llama3-long": ("Llama", dict(rope_scaling=LLAMA3, rope_theta=5e5, tie_word_embeddings=True)),
    "mistral-no-window": ("Mistral", dict(sliding_window=None)),
    "qwen2-window-off-tied": ("Qwen2", dict(use_sliding_window=False, sliding_window=8, tie_word_embeddings=True)),
    "mistral-window-8": ("Mistral", dict(sliding_window=8)),
    "mistral-window-16": ("Mistral", dict(sliding_window=16)),                   # Mistral-7B-v0.1's, shrunk
    "qwen2-window-every-layer": ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "mistral-window-of-the-positions": ("Mistral", dict(sliding_window=256)),     # never hides a key
    "qwen2-window-on-no-layer": ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen2-window-past-the-positions": ("Qwen2", dict(use_sliding_window=True, sliding_window=300, max_window_layers=0)),
    "qwen2-window-on": ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3-gqa-head-dim-32": ("Qwen3", dict(head_dim=32)),
    "qwen3-tied-head-dim-24-bias": ("Qwen3", dict(head_dim=24, tie_word_embeddings=True, attention_bias=True)),
    "qwen3-window-every-layer": ("Qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "qwen3-window-on": ("Qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gemma": ("Gemma", dict(head_dim=16)),
    "gemma2": ("Gemma2", dict(head_dim=16, sliding_window=8)),
    "phi3": ("Phi3", dict(num_key_value_heads=4)),
}
NATIVE = {"llama-gqa-tied", "llama-head-dim-24-biases", "llama-linear-theta", "llama-llama3-long",
          "mistral-no-window", "qwen2-window-off-tied", "mistral-window-of-the-positions", "qwen2-window-on-no-layer",
          "qwen2-window-past-the-positions", "mistral-window-8", "mistral-window-16", "qwen2-window-every-layer",
          "qwen3-gqa-head-dim-32", "qwen3-tied-head-dim-24-bias", "qwen3-window-every-layer"}


def served_pair(tmp_path: Path, kind: str, **config):
    """(transformers' model, the server's ServedModel) of one tiny random model, fp32."""
    import transformers
    from conftest import _tiny_tokenizer
    tok = _tiny_tokenizer(tmp_path / "hf")
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    cfg = getattr(transformers, f"{kind}Config")(**ids, **{**SIZES, **config})
    torch.manual_seed(0)
    theirs = getattr(transformers, f"{kind}ForCausalLM")(cfg).eval()
    with torch.no_grad():                                       # biases and norms off their 0 / 1 init
        for n, p in theirs.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "hf")
    compress(tmp_path / "hf", tmp_path / "m.wcodec", workers=1)
    with Archive.open(tmp_path / "m.wcodec") as archive:
        opened = archive.entries, archive.reader.files()
    prepared = build.prepare("m", opened[1])
    decoded = pipeline.decode_archive(str(tmp_path / "m.wcodec"), torch.device("cpu"), opened=opened)
    return theirs, build.finish("m", prepared, decoded.tensors, decoded.layers, torch.device("cpu"))


@torch.inference_mode()
def greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """`new` greedy tokens of each prompt, the prompts left-padded into one batch (the batcher's KV)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    real = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kv, out = PaddedKV(torch.device("cpu"), cache_class(model), rows=len(prompts)), []
    for _ in range(new):
        ids = forward_all(model, [(kv, ids, real)])[0].argmax(-1)[:, None]        # [B, 1]
        real = torch.ones_like(ids)
        out.append(ids[:, 0].tolist())
    return [list(t) for t in zip(*out)]


@torch.inference_mode()
def their_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(new):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.filterwarnings("error:`past_key_values` is deprecated:FutureWarning")   # removed in 5.40
@pytest.mark.parametrize("case", CASES)
def test_the_served_model_computes_what_transformers_computes(tmp_path: Path, case: str) -> None:
    kind, config = CASES[case]
    theirs, served = served_pair(tmp_path, kind, **config)
    assert isinstance(served.model, llama.LlamaForCausalLM) == (case in NATIVE)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 280, (n,)).tolist() for n in (40, 23)]
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        torch.testing.assert_close(served.model(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert greedy(served.model, prompts, 6) == [their_greedy(theirs, p, 6) for p in prompts]


def test_a_buffer_nothing_rebuilds_fails_the_load_typed() -> None:
    """A non-persistent buffer left on meta by a module that neither its config nor the model's
    `_init_weights` rebuilds: LoadFailed naming it, not a model computing with garbage."""
    from service.errors import LoadFailed

    class Scaled(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.scale = torch.nn.Buffer(torch.tensor(scale), persistent=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Scaled(2.0)

        def _init_weights(self, module):
            pass

    with torch.device("meta"):
        model = Model()
    with pytest.raises(LoadFailed, match=r"cannot rebuild inner \(Scaled\): its buffers \['scale'\] are not set"):
        build._rebuild_meta_buffers(model, None, torch.device("cpu"))


@pytest.mark.parametrize("case", sorted(NATIVE))
@pytest.mark.parametrize("kernels", ["modules", "cpu-step"])
def test_the_paged_engine_batched_and_chunked_computes_what_transformers_computes(tmp_path: Path, case: str,
                                                                                  kernels: str) -> None:
    """Two prompts, one in two chunks beside the other whole, then decode rows beside the second
    chunk and both rows decoding: each logit row that of transformers' model on that row alone."""
    from cuda_ext import step_kernels
    from service.engine.runner import Chunk, Decode, Runner
    from service.model import paged
    fused = step_kernels.cpu_kernels(torch.device("cpu")) if kernels == "cpu-step" else None
    if kernels == "cpu-step" and fused is None:
        pytest.skip("the extension's CPU step ops are not built")
    theirs, served = served_pair(tmp_path, *CASES[case][:1], **CASES[case][1])
    paged.fuse_projections(served.model)
    torch.manual_seed(2)
    p0, p1 = torch.randint(3, 280, (45,)).tolist(), torch.randint(3, 280, (13,)).tolist()
    t0, t1 = list(range(12)), list(range(12, 16))                            # block tables, 4 tokens a block
    cache = paged.PagedCache(served.model.config, 16, 4, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        runner = Runner(served.model, cache, 4, 16, False, fused)
        a = runner.run([], [Chunk(p0[:20], 0, t0), Chunk(p1, 0, t1)])
        n1 = int(a[1].argmax())
        b = runner.run([Decode(n1, 13, t1)], [Chunk(p0[20:], 20, t0)])
        n0, n1b = int(b[1].argmax()), int(b[0].argmax())
        c = runner.run([Decode(n0, 45, t0), Decode(n1b, 14, t1)], [])
        r0 = theirs(input_ids=torch.tensor([p0 + [n0]])).logits[0]             # [46, V]
        r1 = theirs(input_ids=torch.tensor([p1 + [n1, n1b]])).logits[0]        # [15, V]
    got = torch.stack([a[0], a[1], b[0], b[1], c[0], c[1]])
    want = torch.stack([r0[19], r1[12], r1[13], r0[44], r0[45], r1[14]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
