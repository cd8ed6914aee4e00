"""Write a GGUF file holding a subset of another's tensors (all metadata kept, data untouched).

Used to carry the 98 MB demo model to a lent GPU machine in parts that fit one transfer:
    python scripts/gguf_subset.py SRC.gguf DST.gguf 'token_embd|blk\\.([0-9]|1[0-4])\\.'
"""
from __future__ import annotations

import re
import struct
import sys

import gguf
import numpy as np


def subset(src: str, dst: str, pattern: str) -> int:
    reader = gguf.GGUFReader(src)
    raw = np.memmap(src, dtype=np.uint8, mode="r")
    keep = [t for t in reader.tensors if re.search(pattern, t.name)]
    kv_end = min(t.field.offset for t in reader.tensors)            # KV pairs end where infos start
    align = int(reader.alignment)
    infos, datas, offset = [], [], 0
    for t in keep:
        name = t.name.encode()
        dims = [int(d) for d in t.shape]
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", int(t.tensor_type), offset))
        data = raw[t.data_offset:t.data_offset + t.n_bytes].tobytes()
        datas.append(data + b"\0" * (-len(data) % align))
        offset += len(datas[-1])
    magic, version = struct.unpack("<II", raw[:8].tobytes())
    header = struct.pack("<IIQQ", magic, version, len(keep), len(reader.fields) - _n_header_fields(reader))
    body = header + raw[24:kv_end].tobytes() + b"".join(infos)
    with open(dst, "wb") as f:
        f.write(body + b"\0" * (-len(body) % align))
        for d in datas:
            f.write(d)
    return len(keep)


def _n_header_fields(reader: gguf.GGUFReader) -> int:
    return sum(1 for name in reader.fields if name.startswith("GGUF."))


if __name__ == "__main__":
    print(subset(sys.argv[1], sys.argv[2], sys.argv[3]), "tensors")
