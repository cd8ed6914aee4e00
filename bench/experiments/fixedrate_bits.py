"""Two builds of the fused kernel give the same bits (issue 24): `save` writes the tensor-core op's
outputs (kernel 0) on the trained-like Llama-3-8B layer's seven matrices and seven fuzzed ones
(ragged rows and K, 3 % of weights ×300 in half of them, one fp16) at 17..64 rows of x (or the rows
given), with each batch's row 3 (or its last) computed alone (batch invariance) and each output's
worst error beside cuBLAS bf16's against float32 on the decoded weights; `cmp` compares two such
files. Swap the extension's library between the two `save` runs (docs/BENCHMARKS.md, 2026-11-29).

    python bench/experiments/fixedrate_bits.py save /tmp/a.pt [1,2,4]   # one build [at these rows of x]
    python bench/experiments/fixedrate_bits.py save /tmp/b.pt [1,2,4]   # the other
    python bench/experiments/fixedrate_bits.py cmp /tmp/a.pt /tmp/b.pt
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fine_decode import LAYER_8B  # noqa: E402
from gpu_bench import weights  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402

ROWS = (17, 20, 24, 32, 33, 40, 48, 57, 64)
FUZZED = ((77, 1000), (1000, 4100), (300, 2304), (129, 128), (16, 9000), (520, 3000))


def fuzzed(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for i, (r, c) in enumerate(FUZZED):
        scale = 0.02 * torch.exp(0.35 * torch.randn(r, 1, generator=g, device="cuda"))
        w = torch.randn(r, c, generator=g, device="cuda") * scale
        w = torch.where(torch.rand(r, c, generator=g, device="cuda") < (1e-4 if i % 2 else 3e-2), w * 300, w)
        out[f"fuzzed{i}"] = w.bfloat16()
        if i == 2:
            out[f"fuzzed{i}_fp16"] = w.half()
    return out


def save(path: str, rows: tuple[int, ...] = ROWS) -> None:
    ws = {k: v.cuda() for k, v in weights(LAYER_8B, seed=1).items()} | fuzzed(5)
    res = {}
    for name, w in ws.items():
        form = fr_ops.encode(w)
        decoded = fr_ops.decode(form)
        for n in rows:
            x = torch.randn(n, w.shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).to(w.dtype)
            y = fr_ops.linear(x, form, 0)
            ref = x.float() @ decoded.float().T
            res[f"{name}/{n}"] = y.cpu()
            i = min(3, n - 1)
            res[f"{name}/{n}/alone"] = torch.tensor(torch.equal(y[i:i + 1], fr_ops.linear(x[i:i + 1], form, 0)))
            res[f"{name}/{n}/err"] = torch.tensor([(y.float() - ref).abs().max().item(),
                                                   ((x @ decoded.T).float() - ref).abs().max().item()])
    torch.save(res, path)


def cmp(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    outputs = [k for k in a if k.count("/") == 1]
    differ = [k for k in outputs if not torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))]
    variant = [k for k in b if k.endswith("/alone") and not bool(b[k])]
    worst = max((b[k][0] / max(b[k][1].item(), 1e-30)).item() for k in b if k.endswith("/err"))
    print(f"{b_path} against {a_path}: {len(differ)} of {len(outputs)} outputs differ {differ[:8]}; "
          f"rows whose sums depend on their batch: {variant[:8]}; worst error / cuBLAS's {worst:.3f}")


if __name__ == "__main__":
    rows = tuple(map(int, sys.argv[3].split(","))) if len(sys.argv) > 3 and sys.argv[1] == "save" else ROWS
    {"save": lambda: save(sys.argv[2], rows), "cmp": lambda: cmp(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
