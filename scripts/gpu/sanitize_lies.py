"""Mutated archives through the CUDA decoder, for `compute-sanitizer --tool memcheck`: every read
must be a typed CodecError or a tensor, and the sanitizer must report no error. Exits non-zero on an
untyped exception."""
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo (this file is in scripts/gpu/)

from tests.faults.archives import base_archive, mutate, outcome, readers  # noqa: E402


def main(count: int) -> int:
    work = Path(tempfile.mkdtemp(prefix="wcodec-sanitize-"))
    archive, state = base_archive(work / "base.wcodec")
    read = readers(cuda=True)["cuda-nv"]
    rng, kinds = random.Random(3), {}
    for _ in range(count):
        rewritten, _, _ = mutate(archive, rng)
        (work / "m.wcodec").write_bytes(rewritten)
        got = outcome(read, work / "m.wcodec", state)
        kinds[got.kind] = kinds.get(got.kind, 0) + 1
    print(f"sanitized mutations: {count}, outcomes {kinds}")
    return 1 if kinds.get("untyped") else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100))
