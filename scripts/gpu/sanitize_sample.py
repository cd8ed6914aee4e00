"""A small decode for `compute-sanitizer --tool memcheck`: valid streams of every dtype in every
mode (bulk, recording the resident index, pieces from it), then corrupt streams and a corrupt
index, all through the CUDA op; then the stream checksums (crc32_spans) over spans of every edge
size, before and after a flip. Exits non-zero if a decode or a checksum is wrong or a status is missed."""
import sys
import zlib

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
    crc_ok = check_crcs(data)
    torch.cuda.synchronize()
    print(f"checksums {'ok' if crc_ok else 'WRONG'}")
    print(f"sample decode {'ok' if ok else 'WRONG'}; corrupt trials whose flips left every status 0: {missed}/24; "
          f"corrupt index entry caught: {index_caught}")
    return 0 if ok and index_caught and crc_ok else 1


def check_crcs(data: torch.Tensor) -> bool:
    """crc32_spans against zlib on spans of edge sizes (ending at the buffer's last byte too), then
    on the same spans with one byte flipped."""
    n = data.numel()
    spans = torch.tensor([[0, n], [1, n - 1], [n - 3, 3], [n, 0], [5, 256], [7, min(n - 7, 65537)]],
                         dtype=torch.int64)
    ok = True
    for buf in (data, data.clone().index_fill_(0, torch.tensor([n // 2], device=data.device), 7)):
        host = buf.cpu().numpy()
        ok &= ops.crc32_spans(buf, spans).tolist() == [zlib.crc32(host[o:o + m]) for o, m in spans.tolist()]
    return ok


if __name__ == "__main__":
    sys.exit(main())
