"""Cold start, one checkout against another: rounds of `wcodec serve` first token (bench/cold_start.py's
`ours`, CRCs on) from BASE and from this tree, in alternating order, and transformers' in every round;
medians, `import torch`'s end in each server's timeline, paired ratios. The store and folder are
bench/cold_start.py's (run it once with the same --work to make them).

    git archive <commit> | tar -x -C /tmp/base   (and copy cuda_ext/_C*.so there)
    PYTHONPATH=. python bench/experiments/cold_start_ab.py --base /tmp/base --rounds 8 --work /tmp/wcodec-coldstart"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(root: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, root / "bench" / "cold_start.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout's root")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--work", default="/tmp/wcodec-coldstart")
    ap.add_argument("--json")
    args = ap.parse_args()
    sides = {"base": _bench(Path(args.base), "cold_start_base"), "new": _bench(ROOT, "cold_start_new")}
    work = Path(args.work)
    store, weights = work / "store", work / "hf" / "model.safetensors"
    rows: dict[str, list[dict]] = {"base": [], "new": [], "theirs": []}
    for i in range(args.rounds):
        for side in (["base", "new"] if i % 2 == 0 else ["new", "base"]) + ["theirs"]:
            sides["new"].warm([store / "model.wcodec", weights])
            if side == "theirs":
                r = sides["new"].theirs(work / "hf", args.device)
            else:
                r = sides[side].ours(store, args.device, True, work / "logs" / f"ab-{side}-{i}.log")
                r["torch_end_s"] = next(e["end"] for e in r["timeline"] if e["name"] == "import torch")
            rows[side].append(r)
            print(i, side, f"first token {r['first_token_s']:.2f} s, imports {r['import_s']:.2f} s", flush=True)
    for side, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("first_token_s", "import_s", "torch_end_s")
               if k in runs[0]}
        print(side, {k: round(v, 3) for k, v in med.items()})
    for side in ("base", "new"):
        ratios = [o["first_token_s"] / t["first_token_s"] for o, t in zip(rows[side], rows["theirs"])]
        print(side, "paired ratios", [round(r, 3) for r in ratios], "median", round(statistics.median(ratios), 3))
    if args.json:
        Path(args.json).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
