"""Which bad-input check of the CUDA ops segfaults in this build (one case a process)."""
import sys, torch
from cuda_ext import fixedrate as fr_ops, ops
case = sys.argv[1]
dev = "cuda" if case.endswith("cuda") else "cpu"
fr = fr_ops.encode(fr_ops.sample_weight(torch.bfloat16, 1024, 4096, seed=1, finite=True).to(dev))
x = torch.randn(64, 4096, device=dev).bfloat16()
with fr_ops.fused_rows(fr_ops.FUSED_MAX_ROWS):
    p = fr_ops.permute(x)
try:
    if case.startswith("rows"):
        ops.fixedrate_linear_permuted(p.data, 6, *fr.arrays, fr.cols)
    elif case.startswith("shape"):
        ops.fixedrate_linear_permuted(p.data[:, :-128].contiguous(), 64, *fr.arrays, fr.cols)
    elif case.startswith("good"):
        ops.fixedrate_linear_permuted(p.data, 64, *fr.arrays, fr.cols)
    elif case.startswith("cols"):
        ops.fixedrate_linear(x, *fr.arrays, fr.cols + 200, 0)
    elif case.startswith("index"):
        ops.fixedrate_permuted_index(6, 100)
    elif case.startswith("kernel"):
        ops.fixedrate_linear(x, *fr.arrays, fr.cols, 5)
    elif case.startswith("linear"):
        ops.fixedrate_linear(x.float(), *fr.arrays, fr.cols, 0)
    print(case, "no error")
except RuntimeError as e:
    print(case, "RuntimeError:", str(e).splitlines()[0][:100])
