"""Ratio on one trained-like Llama-3-8B layer (bench/fine_decode.py's weights, made on the CPU):
our file and our resident form (streams + resident index), beside DFloat11's own encoder and
ZipNN, on the same bf16 tensors. CPU only (nvCOMP needs a GPU: fine_decode.py has it).

    python bench/ratio_8b.py [--entry-steps 256] [--no-dfloat11]

DFloat11's package imports cupy and accelerate; only its CPU encoder (dfloat11_utils) is used
here, loaded from its file.
"""
from __future__ import annotations

import argparse
import json
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch
from fine_decode import LAYER_8B
from gpu_bench import weights

import cuda_ext
from codec.decode import Archive
from codec.encode import compress_state_dict
from cuda_ext import plans


def ours(layer: dict, entry_steps: int) -> dict:
    path = Path(tempfile.mkdtemp(prefix="wcodec-ratio-")) / "layer.wcodec"
    stats = compress_state_dict(layer, path, workers=2)
    with Archive.open(path) as a:
        p = plans.build(a.entries, a.path)
        data = torch.from_numpy(a.reader.buf[p.start:p.end].copy())
    out, index = cuda_ext.build_index(p, data, entry_steps)
    assert all(torch.equal(out[k].view(torch.int16), v.view(torch.int16)) for k, v in layer.items())
    raw = sum(t.nbytes for t in layer.values())
    return {"file": stats.file_bytes / raw, "resident": (data.numel() + index.nbytes) / raw,
            "index_bytes": index.nbytes, "entry_steps": entry_steps}


def _dfloat11_utils():
    """dfloat11.dfloat11_utils without the package __init__ (which needs cupy and accelerate)."""
    folder = importlib.util.find_spec("dfloat11").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("dfloat11_utils", os.path.join(folder, "dfloat11_utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dfloat11(layer: dict) -> dict:
    utils = _dfloat11_utils()
    encode_weights, get_32bit_codec, get_codec = utils.encode_weights, utils.get_32bit_codec, utils.get_codec
    flat = [t.flatten() for t in layer.values()]
    _, counter = get_codec(torch.cat(flat))
    codec, _, _ = get_32bit_codec(counter)
    t = time.perf_counter()
    encoded, other, positions, gaps, _ = encode_weights(flat, codec, bytes_per_thread=8, threads_per_block=512)
    stored = encoded.numel() + other.numel() + positions.numel() * positions.element_size() + gaps.numel()
    return {"ratio_without_luts": stored / (2 * other.numel()), "encode_s": time.perf_counter() - t}


def zipnn(layer: dict) -> dict:
    from zipnn import ZipNN
    z = ZipNN(input_format="byte", bytearray_dtype="bfloat16")
    raw = sum(t.nbytes for t in layer.values())
    return {"ratio": sum(len(z.compress(t.contiguous().view(torch.uint8).numpy().tobytes()))
                         for t in layer.values()) / raw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entry-steps", type=int, default=256)
    ap.add_argument("--no-dfloat11", action="store_true")
    args = ap.parse_args()
    layer = weights(LAYER_8B, seed=1, device="cpu")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "weights": "trained-like Llama-3-8B layer (CPU generator, seed 1)",
           "raw_MB": sum(t.nbytes for t in layer.values()) / 1e6, "ours": ours(layer, args.entry_steps),
           "zipnn": zipnn(layer)}
    print(json.dumps(res), flush=True)
    if not args.no_dfloat11:
        res["dfloat11"] = dfloat11(layer)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
