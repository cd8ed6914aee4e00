"""A model's sampling defaults (service/model/defaults.py): the keys its generation_config.json
sets among those vLLM's `--generation-config auto` honours, checked; nothing else, and never
transformers' class defaults."""
from __future__ import annotations

import json

import pytest

from service.model.defaults import sampling_defaults


def test_only_the_keys_the_file_sets_among_vllms() -> None:
    llama3 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009], "temperature": 0.6,
              "top_p": 0.9, "transformers_version": "4.45.0.dev0"}
    assert sampling_defaults("m", json.dumps(llama3).encode()) == {"temperature": 0.6, "top_p": 0.9}
    every = {"temperature": 0, "top_p": 1, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
             "max_new_tokens": 512.0, "typical_p": 0.5, "num_beams": 4}
    got = sampling_defaults("m", json.dumps(every).encode())
    assert got == {"temperature": 0.0, "top_p": 1.0, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                   "max_new_tokens": 512}
    assert isinstance(got["max_new_tokens"], int) and isinstance(got["top_k"], int)


def test_a_file_made_from_a_model_config_sets_no_sampling_default() -> None:
    """What codec/gguf_source.py embeds for a GGUF (GenerationConfig.from_model_config, written as
    transformers writes it): its special tokens only, so the demo samples with vLLM's neutral
    defaults; transformers' class defaults (4's top_k 50) are not the model's."""
    from transformers import GenerationConfig, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, bos_token_id=1, eos_token_id=2)
    blob = GenerationConfig.from_model_config(config).to_json_string().encode()
    assert sampling_defaults("m", blob) == {}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"temperature": "0.7"}, {"top_p": 0}, {"top_p": 1.5},
                                 {"top_k": 2.5}, {"top_k": True}, {"min_p": 2}, {"repetition_penalty": 0},
                                 {"max_new_tokens": 0}, {"max_new_tokens": 1e400}])
def test_a_value_a_request_could_not_give_is_left_out(bad, caplog) -> None:
    blob = json.dumps({**bad, "top_p": 0.5} if "top_p" not in bad else bad).encode()
    expect = {} if "top_p" in bad else {"top_p": 0.5}
    assert sampling_defaults("m", blob) == expect
    assert next(iter(bad)) in caplog.text


@pytest.mark.parametrize("blob", [None, b"", b"[1, 2]", b"{not json"])
def test_no_file_or_no_object_is_no_default(blob) -> None:
    assert sampling_defaults("m", blob) == {}
