#!/usr/bin/env bash
# What the lent GPU box lacks (it has torch, cupy, triton, transformers, prometheus-client; no
# network), made here for scripts/gpu/run.sh; pass the made folders as the run's `carry`.
#   service   .whl/      the service's wheels for CPython 3.12 (fastapi, uvicorn, pydantic, gguf, ...)
#             .gentok/   the demo model's tokenizer files (the 7B-shaped models borrow them)
#   load      .whl/      + locust and gevent (the generation stage's load script)
#   peers     .whlpeers/ DFloat11 (+ dahuffman) and nvCOMP: the decode stage's peers
#   optional  .whl/      + accelerate, psutil (transformers' device_map="cuda" in the cold-start stage)
# Usage (repo root, here): bash scripts/gpu/carry.sh service [load] [peers] [optional]
set -euo pipefail
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
exclude="$(git rev-parse --git-path info/exclude)"
for d in /.whl/ /.whlpeers/ /.gentok/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
for set in "${@:-service}"; do
  case $set in
    service) mkdir -p .whl .gentok
             python -m pip download -q $PLAT -d .whl fastapi uvicorn pydantic-settings prometheus-client httpx xxhash \
               outlines-core
             python -m pip download -q --no-deps $PLAT -d .whl gguf pytest-timeout
             # the box's own numpy, pytest and jinja2 stay: a newer copy in /tmp/site would shadow them
             rm -f .whl/numpy-* .whl/pytest-[0-9]* .whl/pluggy-* .whl/iniconfig-* .whl/pygments-* .whl/jinja2-* \
               .whl/markupsafe-* .whl/requests-* .whl/urllib3-* .whl/charset_normalizer-*
             PYTHONPATH=. python scripts/gpu/demo_tokenizer.py .gentok ;;
    load) python -m pip download -q $PLAT -d .whl locust ;;
    peers) mkdir -p .whlpeers
           python -m pip download -q --no-deps $PLAT -d .whlpeers dfloat11==0.5.0 dahuffman==0.4.2 \
             nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 ;;
    optional) python -m pip download -q --no-deps $PLAT -d .whl accelerate psutil ;;
    *) echo "unknown set $set (service, load, peers, optional)" >&2; exit 2 ;;
  esac
done
du -sh .whl* .gentok 2>/dev/null
