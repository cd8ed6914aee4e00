"""A small decode for `compute-sanitizer --tool memcheck`: valid streams of every dtype, then
corrupt ones, all through the CUDA op. Exits non-zero if a decode is wrong or a status is missed."""
import sys

import torch

import cuda_ext
from cuda_ext import ops


def main() -> int:
    assert cuda_ext.available().cuda, cuda_ext.available()
    (args,), ref = ops.sample_inputs("cuda")
    data, desc, outputs, n_seg = args
    status = ops.decode_float(data, desc, outputs, n_seg)
    ok = int(status.abs().sum()) == 0 and all(torch.equal(o.cpu(), t.reshape(o.shape)) for o, t in zip(outputs, ref.values()))
    g = torch.Generator().manual_seed(1)
    missed = 0
    for trial in range(24):                                  # flip bytes anywhere in the buffer
        bad = data.clone()
        pos = torch.randint(0, data.numel(), (4,), generator=g).to(data.device)
        bad[pos] ^= torch.randint(1, 255, (4,), generator=g, dtype=torch.uint8).to(data.device)
        st = ops.decode_float(bad, desc, [torch.empty_like(o) for o in outputs], n_seg)
        missed += int(st.abs().sum()) == 0 and not torch.equal(bad, data)
    torch.cuda.synchronize()
    print(f"sample decode {'ok' if ok else 'WRONG'}; corrupt trials whose flips left every status 0: {missed}/24")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
