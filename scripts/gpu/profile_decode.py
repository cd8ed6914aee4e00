"""One indexed decode launch of each granularity (a trained-like Llama-3-8B layer, one 4096² and one
1024×4096 tensor) between cudaProfilerStart/Stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section Occupancy python3 scripts/gpu/profile_decode.py [ENTRY_STEPS]
"""
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from fine_decode import LAYER_8B, Resident  # noqa: E402
from gpu_bench import weights  # noqa: E402


def main(entry_steps: int) -> None:
    ours = Resident(weights(LAYER_8B, seed=1), Path(tempfile.mkdtemp(prefix="wcodec-prof-")), "prof", entry_steps)
    for names in (list(LAYER_8B), ["q"], ["k"]):
        job = ours.job(names)
        job.run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        job.run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled", names, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
