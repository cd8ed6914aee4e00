"""What serving needs of a Hugging Face fast tokenizer, on the `tokenizers` library alone (a tenth
of a second to import, against seconds for transformers): encode, decode, the special tokens and
the chat template, rendered as transformers renders it (a sandboxed jinja2, trim_blocks and
lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`, special tokens as
variables).

`Tokenizer.from_files` returns None where transformers' tokenizer class would change behaviour
(a class other than the generic fast ones, or add_bos/add_eos overrides): such models use
transformers' AutoTokenizer (service/model/build.py)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property, lru_cache

from tokenizers import Tokenizer as RustTokenizer

GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast",
                   "Qwen2Tokenizer", "Qwen2TokenizerFast"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
KEPT = 8                                        # tokenizers kept by content (Tokenizer.from_files)
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(files: dict[str, bytes], config: dict) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode()
    template = config.get("chat_template")
    if isinstance(template, list):              # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


class Tokenizer:
    def __init__(self, rust: RustTokenizer, config: dict, special: dict[str, str], chat_template: str | None):
        self._tok, self._config, self.special_tokens_map = rust, config, special
        self.chat_template = chat_template
        for name in SPECIAL:
            setattr(self, name, special.get(name))
            setattr(self, f"{name}_id", self._id(special.get(name)))

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> Tokenizer | None:
        """The tokenizer of a model's embedded files. Kept by content (the last KEPT): a model
        switched out and back in, or served twice, reuses it. Parsing a 49k-token tokenizer.json
        took 0.1-0.25 s holding the GIL, which slowed the loader beside it in every 7B switch."""
        return _kept(cls, tuple(files.get(name) for name in TOKENIZER_FILES))

    @classmethod
    def _parse(cls, files: dict[str, bytes]) -> Tokenizer | None:
        """`files`: the embedded files of TOKENIZER_FILES (the only ones read here)."""
        if "tokenizer.json" not in files:
            return None
        config = json.loads(files.get("tokenizer_config.json", b"{}"))
        if config.get("tokenizer_class", "PreTrainedTokenizerFast") not in GENERIC_CLASSES \
                or config.get("add_bos_token") or config.get("add_eos_token"):
            return None
        special = {**json.loads(files.get("special_tokens_map.json", b"{}")), **config}
        tokens = {name: _content(special[name]) for name in SPECIAL if _content(special.get(name))}
        extra = special.get("additional_special_tokens") or special.get("extra_special_tokens") or []
        tokens["additional_special_tokens"] = [_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        return cls(RustTokenizer.from_str(files["tokenizer.json"].decode()), config, tokens,
                   _chat_template(files, config))

    @property
    def backend_tokenizer(self) -> RustTokenizer:
        """The `tokenizers` object (transformers' fast tokenizers' name for it)."""
        return self._tok

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @cached_property
    def added_tokens_decoder(self) -> dict:
        """id -> AddedToken (its `special` flag: decode(skip_special_tokens=True) drops it)."""
        return self._tok.get_added_tokens_decoder()

    @cached_property
    def all_special_ids(self) -> list[int]:
        names = [self.special_tokens_map.get(n) for n in SPECIAL] + self.special_tokens_map["additional_special_tokens"]
        ids = [self._id(t) for t in dict.fromkeys(n for n in names if n)]
        return [i for i in ids if i is not None]

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _encoding(self, text: str, add_special_tokens: bool):
        """`text`'s encoding, made with the GIL released (the Rust tokenizer's `encode` holds it: a
        prompt of megabytes stalled every other thread, the event loop's included, for seconds)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encoding(text, add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False) -> dict[str, list]:
        """transformers' fast tokenizer's result: ids, mask and, asked for, each token's
        (start, stop) characters in `text` ((0, 0) for an added special token)."""
        enc = self._encoding(text, add_special_tokens)
        out = {"input_ids": enc.ids, "attention_mask": [1] * len(enc.ids)}
        if return_offsets_mapping:
            out["offset_mapping"] = [tuple(o) for o in enc.offsets]
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self):
        return _environment().from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        variables = {**self.special_tokens_map, **kwargs}
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@lru_cache(maxsize=1)
def _environment():
    """transformers' chat template environment: a sandbox with trim_blocks and lstrip_blocks, loop
    controls, its `tojson`, `raise_exception`, `strftime_now`, and its `{% generation %}` block
    (which marks the assistant's tokens for training masks; it renders as its body)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


@lru_cache(maxsize=KEPT)
def _kept(cls: type[Tokenizer], blobs: tuple[bytes | None, ...]) -> Tokenizer | None:
    return cls._parse({name: blob for name, blob in zip(TOKENIZER_FILES, blobs) if blob is not None})
