"""A small decode for `compute-sanitizer --tool memcheck`: valid streams of every dtype in every
mode (bulk, recording the resident index, pieces from it), then corrupt streams and a corrupt
index, all through the CUDA op. Exits non-zero if a decode is wrong or a status is missed."""
import sys

import torch

import cuda_ext
from cuda_ext import ops


def main() -> int:
    assert cuda_ext.available().cuda, cuda_ext.available()
    args, ref = ops.sample_inputs("cuda")
    ok = True
    for a in args:                                           # BULK, RECORD, INDEXED (reads RECORD's index)
        ops.decode_pieces(*a)
        data, desc, plan, outputs, states, words, status = a[:7]
        ok &= int(status.abs().sum()) == 0 and all(torch.equal(o.cpu(), t.reshape(o.shape))
                                                   for o, t in zip(outputs, ref.values()))
    g = torch.Generator().manual_seed(1)
    missed = 0
    for trial in range(24):                                  # flip bytes anywhere in the buffer
        bad = data.clone()
        pos = torch.randint(0, data.numel(), (4,), generator=g).to(data.device)
        bad[pos] ^= torch.randint(1, 255, (4,), generator=g, dtype=torch.uint8).to(data.device)
        data_i, desc_i, plan_i, outs_i, st_i, wd_i, status_i, mode, steps = args[trial % 3]
        status_i.zero_()
        ops.decode_pieces(bad, desc_i, plan_i, outs_i, st_i.clone(), wd_i.clone(), status_i, mode, steps)
        missed += int(status_i.abs().sum()) == 0 and not torch.equal(bad, data)
    bad_states = states.clone()
    bad_states[32 * 3 + 7] ^= 0x100                         # entry 3 of the first tensor
    status.zero_()
    ops.decode_pieces(data, desc, args[2][2], args[2][3], bad_states, words, status, *args[2][7:])
    index_caught = int(status.abs().sum()) != 0
    torch.cuda.synchronize()
    print(f"sample decode {'ok' if ok else 'WRONG'}; corrupt trials whose flips left every status 0: {missed}/24; "
          f"corrupt index entry caught: {index_caught}")
    return 0 if ok and index_caught else 1


if __name__ == "__main__":
    sys.exit(main())
