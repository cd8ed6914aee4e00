"""service/model/tokenizer.py against transformers on the same files: chat templates that use
transformers' template extensions render as transformers renders them."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from service.model.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é 中"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
              "{% generation %}{% set said = m.content %}{{ said }}<|im_end|>{% endgeneration %}"
              "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}{{ said }}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _folder(tmp_path: Path, template: str) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "Hi", "Bye"])}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="[UNK]", additional_special_tokens=["<|endoftext|>"])
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _both(folder: Path):
    from transformers import AutoTokenizer
    ours = Tokenizer.from_files({p.name: p.read_bytes() for p in folder.iterdir()})
    assert ours is not None
    return ours, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("prompt", [True, False])
def test_a_generation_block_renders_as_its_body(tmp_path: Path, prompt: bool) -> None:
    """transformers' `{% generation %}` (a mask for training, in the templates of models tuned with
    TRL): a template with it failed every chat with TemplateSyntaxError."""
    ours, theirs = _both(_folder(tmp_path, GENERATION))
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=prompt)
    assert text == theirs.apply_chat_template(MESSAGES, add_generation_prompt=prompt, tokenize=False)
    assert "<|im_start|>assistant\nHello.<|im_end|><|im_start|>user" in text
    assert text.endswith("Bye<|im_end|>" + ("<|im_start|>assistant\n" if prompt else ""))   # `said` stays inside


@pytest.mark.parametrize("offsets", [False, True])
def test_a_long_text_is_encoded_with_the_gil_released(tmp_path: Path, offsets: bool) -> None:
    """The Rust tokenizer's `encode` holds the GIL: a prompt of megabytes (2 MB: 2 to 6.6 s),
    tokenized on the server's validation thread, still stalled the event loop throughout. Here
    the main thread must run while another thread encodes."""
    ours, _ = _both(_folder(tmp_path, GENERATION))
    text = "Hi Bye " * 400_000
    go, done, took = threading.Event(), threading.Event(), []

    def encode():
        go.wait()
        start = time.monotonic()
        ours(text, return_offsets_mapping=offsets)
        took.append(time.monotonic() - start)
        done.set()
    worker = threading.Thread(target=encode)
    worker.start()
    gaps, last = [], time.monotonic()
    go.set()
    while not done.is_set():
        time.sleep(0.001)
        gaps.append(time.monotonic() - last)
        last = time.monotonic()
    worker.join()
    assert took[0] > 0.2, took                   # long enough to tell
    assert max(gaps) < took[0] / 2, (max(gaps), took)
