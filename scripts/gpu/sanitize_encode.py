"""The CUDA encoder's launches under compute-sanitizer (memcheck): the op samples and edge-case
planes (empty tail steps, one segment, several, every dtype code), alone and in one prepare_planes
batch, each checked against the C++ twin.
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/gpu/sanitize_encode.py"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from scripts.gpu.encoder_ext import load_encoder  # noqa: E402

load_encoder()
from cuda_ext import ops  # noqa: E402
from tests.cuda_ext.test_encode_twin import batch_planes, edge_tensor  # noqa: E402

CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float8_e4m3fn: 3}


def check(t: torch.Tensor, code: int) -> bool:
    data = t.reshape(-1).view(torch.uint8)
    got, want = ops.prepare_plane(data.cuda(), code), ops.prepare_plane(data, code)
    same = all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    coded, ctx, group = want[0].tolist()
    if coded:
        s = ops.encode_planes([data.cuda()], [code], [got[1]], [ctx], [group])[0]
        same &= torch.equal(s.cpu(), ops.encode_planes([data], [code], [want[1]], [ctx], [group])[0])
    return same


prepared, encode = ops.sample_encode_inputs("cuda")
ok = all(torch.equal(a.cpu(), b) for a, b in zip(ops.encode_planes(*encode), ops.encode_planes(
    [d.cpu() for d in encode[0]], encode[1], [f.cpu() for f in encode[2]], *encode[3:])))
for dtype, code in CODES.items():
    for n, kind in ((4096, "mixed"), (131072 + 33, "normal"), (3 * 131072 + 5, "bits"), (5000, "normal")):
        ok &= check(edge_tensor(dtype, n, n, kind), code)
data, dtypes = batch_planes("cuda")                 # the batched op: one launch over every dtype code
ok &= all(torch.equal(a.cpu(), b) for a, b in zip(ops.prepare_planes(data, dtypes),
                                                   ops.prepare_planes([d.cpu() for d in data], dtypes)))
torch.cuda.synchronize()
print("sanitize encode: all equal to the C++ twin:", ok)
sys.exit(0 if ok else 1)
