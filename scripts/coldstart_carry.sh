#!/usr/bin/env bash
# What scripts/device_coldstart.sh needs on the GPU box (no network there), made here:
#   .whlsvc/            the service's wheels for CPython 3.12 (and accelerate, used only if absent there)
#   .coldstart/tokenizer the demo model's tokenizer files (the 7B-shaped model borrows them)
set -euo pipefail
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
mkdir -p .whlsvc/optional .coldstart/tokenizer
python -m pip download -q $PLAT -d .whlsvc fastapi uvicorn pydantic-settings prometheus-client httpx xxhash
python -m pip download -q --no-deps $PLAT -d .whlsvc/optional accelerate psutil
python - <<'PY'
import json, tempfile
from pathlib import Path
from service.demo import build_demo
from codec.decode import Archive
archive = build_demo(Path(tempfile.mkdtemp()), workers=2)
with Archive.open(archive) as a:
    files = a.reader.files()
cfg = json.loads(files["tokenizer_config.json"])
cfg["tokenizer_class"] = "PreTrainedTokenizerFast"        # known to transformers 4.x and 5.x alike
for key in ("backend", "is_local", "local_files_only"):
    cfg.pop(key, None)
out = Path(".coldstart/tokenizer")
(out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
for name in ("tokenizer.json", "chat_template.jinja"):
    (out / name).write_bytes(files[name])
PY
du -sh .whlsvc .coldstart
