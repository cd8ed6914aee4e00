#!/usr/bin/env bash
# What scripts/device_generation.sh needs on the GPU box (no network there), made here:
#   .whlgen/   the service's and the load script's wheels (locust, gevent, ...) for CPython 3.12
#   .gentok/   the demo model's tokenizer files (the 7B-shaped model uses its vocabulary)
set -euo pipefail
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
grep -qx '/.whlgen/' .git/info/exclude 2>/dev/null || printf '/.whlgen/\n/.gentok/\n' >> "$(git rev-parse --git-path info/exclude)"
mkdir -p .whlgen .gentok
python -m pip download -q $PLAT -d .whlgen fastapi uvicorn pydantic-settings prometheus-client httpx xxhash locust
python - <<'PY'
import json, tempfile
from pathlib import Path
from codec.decode import Archive
from service.demo import build_demo
archive = build_demo(Path(tempfile.mkdtemp()), workers=2)
with Archive.open(archive) as a:
    files = a.reader.files()
cfg = json.loads(files["tokenizer_config.json"])
cfg["tokenizer_class"] = "PreTrainedTokenizerFast"        # known to transformers 4.x and 5.x alike
for key in ("backend", "is_local", "local_files_only"):
    cfg.pop(key, None)
out = Path(".gentok")
(out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
for name in ("tokenizer.json", "chat_template.jinja", "special_tokens_map.json"):
    if name in files:
        (out / name).write_bytes(files[name])
PY
du -sh .whlgen .gentok
