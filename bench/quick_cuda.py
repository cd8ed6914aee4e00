"""A quick timing of our decoder alone (no peers) for scripts/gpu/run.sh: one trained-like
Llama-3-8B layer decoded from the resident form (per layer, per tensor) and in bulk. The full run,
beside DFloat11 and nvCOMP, is fine_decode.py.

    python bench/quick_cuda.py [ENTRY_STEPS ...]      (default 256; several: one compression, each index)
"""
import json
import sys
import tempfile
from pathlib import Path

from fine_decode import LAYER_8B, Resident
from gpu_bench import weights

from cuda_ext import plans


def main(steps: list[int]) -> None:
    layer = weights(LAYER_8B, seed=1)
    ours = Resident(layer, Path(tempfile.mkdtemp(prefix="wcodec-quick-")), "quick", steps[0])
    for k, entry_steps in enumerate(steps):
        if k:
            ours.reindex(entry_steps)
        print(f"entry_steps {entry_steps}: ratios {json.dumps(ours.ratios)}, record {ours.record_GBps:.0f} GB/s")
        for label, names in (("layer_8B", list(LAYER_8B)), ("q_4096x4096", ["q"]), ("k_1024x4096", ["k"])):
            print(label, "indexed", json.dumps(ours.measure(names)))
            if not k:
                print(label, "bulk   ", json.dumps(ours.measure(names, plans.MODE_BULK)))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [256])
