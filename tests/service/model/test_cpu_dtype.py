"""CPU compute modes (service/model/cpu_dtype.py): which one a model gets, and that the mixed
Linear multiplies in the weight's dtype for a few rows and in float32 for many, with no second
copy of the weights."""
from __future__ import annotations

from dataclasses import dataclass

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cuda_ext import ops
from service.model import llama
from service.model import cpu_dtype


def served(dtype=torch.bfloat16, device="cpu", weights="decoded"):
    return SimpleNamespace(dtype=dtype, device=torch.device(device), weights=weights)


@pytest.mark.parametrize(("setting", "kw", "want"), [
    ("model", {}, "model"),
    ("float32", {}, "float32"),
    ("float32", {"dtype": torch.float32}, "model"),
    ("float32", {"device": "meta"}, "model"),
])
def test_mode_chosen(setting, kw, want):
    assert cpu_dtype.cpu_compute(served(**kw), setting) == want


def test_auto_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "linear16_kernel", lambda dtype: False)
    monkeypatch.setattr(cpu_dtype, "_native", lambda dtype: False)
    assert cpu_dtype.cpu_compute(served(), "auto") == "mixed"
    monkeypatch.setattr(cpu_dtype, "_native", lambda dtype: True)
    assert cpu_dtype.cpu_compute(served(), "auto") == "model"
    monkeypatch.setattr(cpu_dtype, "linear16_kernel", lambda dtype: True)
    assert cpu_dtype.cpu_compute(served(), "auto") == "linear16"
    assert cpu_dtype.cpu_compute(served(), "model") == "model"
    assert cpu_dtype.cpu_compute(served(weights="compressed"), "auto") == "linear16"   # unpacked: scratch views
    monkeypatch.setattr(cpu_dtype, "linear16_kernel", lambda dtype: False)
    assert cpu_dtype.cpu_compute(served(weights="compressed"), "float32") == "model"   # no cast of the scratch


def test_linear16_kernel_only_for_bf16_with_its_instructions(monkeypatch):
    assert not cpu_dtype.linear16_kernel(torch.float16)
    monkeypatch.setenv("WCODEC_CPU_SIMD", "0")
    assert not cpu_dtype.linear16_kernel(torch.bfloat16)


AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.mark.skipif(not AVX512, reason="needs an AVX-512 CPU")
def test_auto_picks_linear16_on_every_avx512_cpu():
    """linear16 has a SIMD loop on every AVX-512 CPU (vdpbf16ps with AVX512-BF16, else FMAs), and
    packs there: `auto` takes it for bf16 whether the CPU has AVX512-BF16 or not, and a weight
    packs (the trial of 2026-11-28 00:42 let `auto` pick linear16 here while linear16_pack
    refused this CPU: the preload failed, and the server never got ready)."""
    assert cpu_dtype.linear16_kernel(torch.bfloat16)
    assert cpu_dtype.cpu_compute(served(), "auto") == "linear16"
    assert cpu_dtype.cpu_compute(served(weights="compressed"), "auto") == "linear16"
    w = torch.randn(64, 96).bfloat16()
    assert torch.equal(ops.linear16_packed(w[:3], ops.linear16_pack(w)), ops.linear16(w[:3], w))


@pytest.mark.skipif(not cpu_dtype.linear16_kernel(torch.bfloat16), reason="needs an AVX-512 CPU and the extension")
def test_auto_model_multiplies_with_linear16():
    """A served bf16 model under `auto`: every Linear (the tied head too) computes with linear16,
    whose rows do not depend on the rows beside them."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(llama.Linear(64, 32, bias=True), llama.Linear(32, 16, bias=False))
    for m in model:
        m.weight = torch.nn.Parameter(torch.randn(m.weight.shape, generator=g).bfloat16(), requires_grad=False)
    model[0].bias = torch.nn.Parameter(torch.randn(32, generator=g).bfloat16(), requires_grad=False)
    weights = [m.weight.clone() for m in model]
    out = cpu_dtype.for_cpu(Served(torch.bfloat16, torch.device("cpu"), "decoded", model, 0), "auto")
    assert all(type(m) is cpu_dtype.Linear16 for m in out.model)
    assert [m.packed for m in model] == [True, False]                                      # 16 outputs: not packable
    assert out.weight_bytes == 0                                                            # packed in place
    x = torch.randn(9, 64, generator=g).bfloat16()
    y = model(x)
    assert torch.equal(y, ops.linear16(ops.linear16(x, weights[0], model[0].bias), weights[1]))
    assert all(torch.equal(model(x[i:i + 1])[0], y[i]) for i in range(9))


@dataclass
class Served:
    dtype: torch.dtype
    device: torch.device
    weights: str
    model: torch.nn.Module
    weight_bytes: int


def test_a_tied_head_gets_a_packed_copy():
    """A weight two modules hold (a head tied to the embedding, whose rows the embedding gathers)
    stays as it is; its Linear multiplies a packed copy, counted in the model's bytes."""
    if not cpu_dtype.linear16_kernel(torch.bfloat16):
        pytest.skip("linear16_pack needs an AVX-512 CPU")
    g = torch.Generator().manual_seed(1)
    emb, head = llama.Embedding(64, 32), llama.Linear(32, 64, bias=False)
    emb.weight = head.weight = torch.nn.Parameter(torch.randn(64, 32, generator=g).bfloat16(), requires_grad=False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    kept = emb.weight.clone()
    out = cpu_dtype.for_cpu(Served(torch.bfloat16, torch.device("cpu"), "decoded", model, 100), "auto")
    assert torch.equal(emb.weight, kept) and head.weight is emb.weight and not head.packed
    assert out.weight_bytes == 100 + kept.nbytes
    x = torch.randn(3, 32, generator=g).bfloat16()
    assert torch.equal(head(x), ops.linear16(x, kept))
    assert "head.packed_copy" not in model.state_dict()
    model.to("meta")                                                      # an unload
    assert head.packed_copy.is_meta


def test_mixed_linear_paths():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(llama.Linear(64, 32, bias=False), llama.Linear(32, 16, bias=False))
    for m in model:
        m.weight = torch.nn.Parameter(torch.randn(m.weight.shape, generator=g).bfloat16(), requires_grad=False)
    ptrs = [m.weight.data_ptr() for m in model]
    scratch_bytes = cpu_dtype._mix(model, min_rows=6)
    assert scratch_bytes == 64 * 32 * 4
    assert [m.weight.data_ptr() for m in model] == ptrs and all(m.weight.dtype == torch.bfloat16 for m in model)
    lin = model[0]
    few = torch.randn(1, 5, 64, generator=g).bfloat16()                # 5 rows: the bf16 matmul
    many = torch.randn(2, 3, 64, generator=g).bfloat16()               # 6 rows: float32
    assert torch.equal(lin(few), F.linear(few, lin.weight))
    assert torch.equal(lin(many), F.linear(many.float(), lin.weight.float()).bfloat16())
    assert model(many).dtype == torch.bfloat16


def test_a_large_weight_is_widened_in_blocks_of_rows(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "CHUNK_FLOATS", 10 * 64)             # 10 rows of 64 at a time
    g = torch.Generator().manual_seed(0)
    lin = llama.Linear(64, 25, bias=True)                               # blocks of 10, 10 and 5 rows
    lin.weight = torch.nn.Parameter(torch.randn(25, 64, generator=g).bfloat16(), requires_grad=False)
    lin.bias = torch.nn.Parameter(torch.randn(25, generator=g).bfloat16(), requires_grad=False)
    assert cpu_dtype._mix(lin, min_rows=6) == 10 * 64 * 4
    x = torch.randn(2, 4, 64, generator=g).bfloat16()
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16()
    torch.testing.assert_close(lin(x), want, rtol=0, atol=0)
