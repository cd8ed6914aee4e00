"""A row cancelled by the event loop while its batch is mid-step still gets its answer (the storm
found two /generate_stream requests whose clients hung up never answered: their leases were never
released, so the model's unload, and every load behind it, waited forever)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from service.generation import Row, SamplingParams, generate

VOCAB, TOKEN = 16, 5


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def stub_model(input_ids, past_key_values=None, **kw):
    logits = torch.zeros(input_ids.shape[0], 1, VOCAB)
    logits[..., TOKEN] = 1.0                                              # never the end token
    cache = past_key_values or SimpleNamespace(batch_select_indices=lambda idx: None)
    return SimpleNamespace(logits=logits, past_key_values=cache)


def test_a_row_cancelled_after_its_done_check_still_finishes() -> None:
    served = SimpleNamespace(device=torch.device("cpu"), tokenizer=ByteTokenizer(), eos_ids=frozenset({9}),
                             special_ids=frozenset({9}), pad_id=0, model=stub_model)
    first, second = (Row([1, 2], SamplingParams(4), served) for _ in range(2))
    finished = []

    def on_token(row, event):
        if row is second and len(second.ids) == 1:
            first.cancelled = True          # the client of `first` hangs up while `second` is sampled

    generate(served, [first, second], on_token, finished.append)
    assert finished.count(first) == 1 and finished.count(second) == 1
    assert len(second.ids) == 4 and second.finish_reason == "length"
