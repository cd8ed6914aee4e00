#!/usr/bin/env bash
# Builds the wcodec image and checks it end to end (README, "Deploy"). From the repository root:
#
#   deploy/image.sh build          # `make image`:       wcodec:<version>-<variant>
#   deploy/image.sh smoke          # `make image-smoke`: build, then run and check it
#   deploy/image.sh rebuild-check  # a change to service/ alone reuses the dependency layers
#
# VARIANT=cpu|cuda (default cpu), ENGINE=docker|podman (default: docker when its daemon answers,
# else podman), BASE_IMAGE (default: localhost/wcodec-base:12, made by deploy/base/make-base.sh,
# where podman and debootstrap are here; else the Dockerfile's debian:bookworm-slim), CA_BUNDLE
# (the CA bundle pip trusts during the build: a build secret, in no layer), PORT (the smoke's
# host port, 18080).
set -euo pipefail
cd "$(dirname "$0")/.."
DEPLOY=deploy
VARIANT=${VARIANT:-cpu}
TORCH_VERSION=$(sed -n 's/.*pip_install torch==\([0-9.]*\) .*/\1/p' scripts/setup.sh)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE=${IMAGE:-wcodec:${VERSION}-${VARIANT}}
PORT=${PORT:-18080}
LOGS=${LOGS:-/tmp/wcodec-image}
mkdir -p "$LOGS"
say() { printf '%s\n' "image: $*"; }
die() { printf '%s\n' "image: FAILED: $*" >&2; exit 1; }

pick_engine() {
  if [ -n "${ENGINE:-}" ]; then :
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null; then ENGINE=podman
  else die "neither a docker daemon nor podman is here"; fi
  # hosts like this one (hybrid cgroups v1, low hard ulimits): runc and ulimits within the limits
  if [ "$ENGINE" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] && command -v runc >/dev/null; then
    export CONTAINERS_CONF=$PWD/$DEPLOY/podman/containers.conf
  fi
}

pick_base() {
  if [ -n "${BASE_IMAGE:-}" ]; then return; fi
  if [ "$ENGINE" = podman ] && command -v debootstrap >/dev/null && [ "$(id -u)" = 0 ]; then
    "$DEPLOY"/base/make-base.sh
    BASE_IMAGE=localhost/wcodec-base:12
  fi
}

# The CPU torch: the wheel the host's own pip resolves for torch==X+cpu (its find-links, a local
# index, a proxy or download.pytorch.org), put where one RUN bind-mounts it. None: the build asks
# PyTorch's CPU index itself.
stage_cpu_wheel() {
  TORCH_INDEX_ARG=()
  [ "$VARIANT" = cpu ] || return 0
  if python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.11 \
       --platform manylinux_2_28_x86_64 -d "$DEPLOY/wheels" "torch==${TORCH_VERSION}+cpu" >/dev/null 2>&1; then
    say "CPU torch from the host's pip: $(cd "$DEPLOY/wheels" && ls torch-"${TORCH_VERSION}"+cpu-*.whl)"
    TORCH_INDEX_ARG=(--build-arg TORCH_INDEX=)
  else
    say "no local CPU torch wheel: the build asks download.pytorch.org/whl/cpu"
  fi
}

build() {
  pick_engine; pick_base; stage_cpu_wheel
  local args=(--build-arg "TORCH_VARIANT=$VARIANT" "${TORCH_INDEX_ARG[@]}" -t "$IMAGE")
  [ -n "${BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
  local ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
  [ -s "$ca" ] && args+=(--secret "id=ca,src=$ca")
  # podman: docker format (OCI images drop HEALTHCHECK); chroot isolation needs no nested runtime
  [ "$ENGINE" = podman ] && args+=(--format docker --isolation chroot --layers)
  [ "$ENGINE" = docker ] && export DOCKER_BUILDKIT=1 && args+=(--progress plain)
  say "$ENGINE build ${args[*]} ${1:-.}"
  local start=$SECONDS log="$LOGS/build-$VARIANT.log"
  if ! nice -n "${NICE:-10}" "$ENGINE" build "${args[@]}" "${1:-.}" >"$log" 2>&1; then
    tail -n 40 "$log" >&2; die "build (log: $log)"
  fi
  BUILD_S=$((SECONDS - start))
  local steps hits
  # buildah: "[stage] STEP n/m: ..." then "--> Using cache <id>" when cached; BuildKit: "#n CACHED"
  steps=$(grep -E '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/[0-9]+: ' "$log" | grep -v ': FROM ' | sort -u | wc -l)
  hits=$(grep -cE '^--> Using cache|^#[0-9]+ CACHED' "$log" || true)
  say "built $IMAGE in ${BUILD_S} s ($hits of $steps steps from the cache; log: $log)"
  say "size of $IMAGE: $(image_size "$IMAGE")"
}

image_size() {
  "$ENGINE" image inspect --format '{{.Size}}' "$1" | awk '{printf "%.2f GB (%.0f bytes)", $1/1e9, $1}'
}

http() { curl -fsS --max-time "${2:-10}" "http://127.0.0.1:$PORT$1"; }

wait_ready() {
  local start=$SECONDS
  until http /health/ready >/dev/null 2>&1; do
    [ "$("$ENGINE" inspect --format '{{.State.Running}}' "$NAME")" = true ] \
      || { "$ENGINE" logs "$NAME" 2>&1 | tail -n 30 >&2; die "the container exited"; }
    [ $((SECONDS - start)) -lt "${READY_TIMEOUT:-900}" ] || { "$ENGINE" logs "$NAME" 2>&1 | tail -n 30 >&2; die "not ready"; }
    sleep 2
  done
  say "ready in $((SECONDS - start)) s (/health/ready: $(http /health/ready))"
}

# SASS for every architecture of the Dockerfile's TORCH_CUDA_ARCH_LIST in the extension the image
# ships, listed by cuobjdump from the build's ext stage (the runtime image holds no CUDA tools)
check_sass() {
  local archs tmp id
  archs=$(sed -n 's/^ARG TORCH_CUDA_ARCH_LIST="\(.*\)"/\1/p' Dockerfile | tr ';' ' ' | tr -d '.')
  tmp=$(mktemp -d); id=$("$ENGINE" create "$IMAGE")
  "$ENGINE" cp "$id:/opt/wcodec/cuda_ext/." "$tmp/" && "$ENGINE" rm -v "$id" >/dev/null 2>&1
  chmod -R a+rX "$tmp"
  build_ext_stage
  local so; so=$(cd "$tmp" && ls _C*.so)
  "$ENGINE" run --rm -v "$tmp:/check:ro" --entrypoint cuobjdump "$IMAGE-ext" --list-elf "/check/$so" | tee "$LOGS/elf.txt"
  for sm in $archs; do
    grep -q "\.sm_${sm}\." "$LOGS/elf.txt" || die "cuda_ext/$so lacks SASS for sm_$sm"
  done
  say "cuda_ext/$so holds SASS for sm_${archs// /, sm_}"
  rm -rf "$tmp"
}

build_ext_stage() {
  local args=(--build-arg "TORCH_VARIANT=$VARIANT" --target ext -t "$IMAGE-ext")
  [ -n "${BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
  [ "$ENGINE" = podman ] && args+=(--format docker --isolation chroot --layers)
  local ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
  [ -s "$ca" ] && args+=(--secret "id=ca,src=$ca")
  nice -n "${NICE:-10}" "$ENGINE" build "${args[@]}" . >"$LOGS/build-$VARIANT-ext.log" 2>&1 \
    || { tail -n 20 "$LOGS/build-$VARIANT-ext.log" >&2; die "the ext stage"; }
}

# No secret in any layer: the history names no CA file, and no layer holds the bundle given to
# the build or any certificate the host added to it (/usr/local/share/ca-certificates: where an
# intercepting proxy's CA lives).
check_layers() {
  "$ENGINE" history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | cut -c1-150 | tee "$LOGS/history.txt"
  ! grep -qiE 'COPY .*(\.crt|\.pem|secrets)|ADD .*(\.crt|\.pem)' "$LOGS/history.txt" || die "a CA file is copied"
  [ "$ENGINE" = podman ] || { say "layer scan: podman only (history checked)"; return; }
  local ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt} dirs sum needles
  dirs=$("$ENGINE" image inspect --format '{{.GraphDriver.Data.LowerDir}}:{{.GraphDriver.Data.UpperDir}}' "$IMAGE" | tr ':' ' ')
  sum=$(sha256sum <"$ca" | cut -d' ' -f1)
  needles=$(mktemp)
  for crt in /usr/local/share/ca-certificates/*.crt; do
    [ -f "$crt" ] && sed -n '2p' "$crt" >>"$needles"      # a certificate's first base64 line
  done
  local n=0 d
  for d in $dirs; do
    n=$((n + 1))
    if [ -s "$needles" ] && grep -rlF -f "$needles" "$d" 2>/dev/null | head -n 3 | grep .; then
      die "layer $d holds a host-added CA certificate"
    fi
    if find "$d" -type f -size "$(stat -c %s "$ca")c" -exec sha256sum {} + 2>/dev/null | grep -q "$sum"; then
      die "layer $d holds the build's CA bundle"
    fi
  done
  say "no secrets: $n layers scanned: none holds the build's CA bundle or any of the $(wc -l <"$needles") host-added CA certificates"
  rm -f "$needles"
}

smoke() {
  build
  [ "$VARIANT" = cuda ] && check_sass
  NAME=wcodec-smoke-$$
  VOLS=("$NAME-models" "$NAME-cache")
  cleanup() {
    "$ENGINE" rm -f "$NAME" >/dev/null 2>&1 || true
    "$ENGINE" volume rm -f "${VOLS[@]}" >/dev/null 2>&1 || true
  }
  trap cleanup EXIT
  # read-only root; the store and the caches are volumes, /tmp a tmpfs
  # (podman without systemd logs that it cannot time the HEALTHCHECK; the smoke runs it below)
  "$ENGINE" run -d --name "$NAME" --read-only --tmpfs /tmp -v "${VOLS[0]}:/models" -v "${VOLS[1]}:/cache" \
    -p "127.0.0.1:$PORT:8000" "$IMAGE" >"$LOGS/run.log" 2>&1 || { cat "$LOGS/run.log" >&2; die "run"; }
  say "started $NAME (read-only root, volumes /models and /cache, port $PORT)"
  wait_ready
  local answer
  answer=$(curl -fsS --max-time 120 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20,
         "temperature": 0}')
  say "chat: $answer"
  grep -q Paris <<<"$answer" || die "the answer names no Paris"
  # TGI's grammar (outlines-core, a dependency the image must carry): the text is the schema's JSON
  local shaped
  shaped=$(curl -fsS --max-time 120 "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
    -d '{"inputs": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
         "parameters": {"max_new_tokens": 24, "grammar": {"type": "json", "value": {"type": "object",
         "properties": {"capital": {"type": "string", "maxLength": 16}}, "required": ["capital"]}}}}')
  say "grammar: $shaped"
  python3 -c 'import json, sys; assert "Paris" in json.loads(json.loads(sys.argv[1])["generated_text"])["capital"]' \
    "$shaped" || die "the grammar's text is not the schema's JSON naming Paris"
  # every metric family the image's own service registers, on /metrics (counters as <name>_total)
  local families expected missing
  families=$(http /metrics | sed -n 's/^# TYPE \(wcodec_[a-z0-9_]*\) .*/\1/p' | grep -v '_created$' | sed 's/_total$//' | sort -u)
  expected=$("$ENGINE" exec "$NAME" python3 -c \
    'from service.metrics import Metrics; print("\n".join(sorted({f.name for f in Metrics().registry.collect()})))')
  missing=$(comm -13 <(echo "$families") <(echo "$expected"))
  [ -n "$families" ] && [ -z "$missing" ] || die "/metrics lacks: ${missing:-every wcodec_ family}"
  say "/metrics: all $(wc -l <<<"$expected") wcodec_ families of service/metrics.py, e.g. $(head -n 4 <<<"$families" | tr '\n' ' ')"
  local uid; uid=$("$ENGINE" exec "$NAME" id -u)
  [ "$uid" != 0 ] || die "runs as root"
  ! "$ENGINE" exec "$NAME" touch /opt/wcodec/probe 2>/dev/null || die "the root file system is writable"
  say "runs as uid $uid; root file system read-only"
  if [ "$ENGINE" = podman ]; then
    "$ENGINE" healthcheck run "$NAME" 2>/dev/null && say "HEALTHCHECK: healthy (podman healthcheck run)"
  else
    local health=starting start=$SECONDS
    while [ "$health" != healthy ] && [ $((SECONDS - start)) -lt 90 ]; do
      sleep 5; health=$("$ENGINE" inspect --format '{{.State.Health.Status}}' "$NAME")
    done
    [ "$health" = healthy ] || die "HEALTHCHECK: $health"
    say "HEALTHCHECK: healthy"
  fi
  "$ENGINE" stop -t 20 "$NAME" >/dev/null 2>&1 && say "stopped $NAME"
  check_layers
  say "PASSED: $IMAGE, $(image_size "$IMAGE"), built in ${BUILD_S} s"
}

# Copies the build context to a scratch directory, changes one file under service/, rebuilds as
# <image>-rebuildcheck, and shows what was reused: each build step cached or built (a step's result
# is the next "-->" line, except COPY --from, whose source stage prints in between), then the
# runtime image's layers beside the first build's: all but the project's must be the same layers.
rebuild_check() {
  build
  local tmp; tmp=$(mktemp -d)
  git ls-files -z | xargs -0 cp --parents -t "$tmp"
  cp "$DEPLOY"/wheels/*.whl "$tmp/$DEPLOY/wheels/" 2>/dev/null || true
  printf '# rebuild-check %s\n' "$(date +%s)" >>"$tmp/service/__init__.py"
  LOGS=$LOGS/rebuild; mkdir -p "$LOGS"
  local image=$IMAGE; IMAGE=$image-rebuildcheck
  build "$tmp"
  awk '/^(\[[0-9]+\/[0-9]+\] )?STEP [0-9]+\/[0-9]+: / {
         step = ($0 ~ /: (FROM|COPY --from)/) ? "" : substr($0, 1, 120); next }
       /^--> Using cache/ { if (step != "") print "cached " step; step = ""; next }
       /^--> [0-9a-f]+$/ { if (step != "") print "BUILT  " step; step = "" }' \
    "$LOGS/build-$VARIANT.log" | tee "$LOGS/steps.txt"
  ! grep -E '^BUILT .*(pip-install|build_ext|COPY pyproject.toml /tmp)' "$LOGS/steps.txt" \
    || die "a dependency step was rebuilt"
  # the runtime's layers, bottom first: the same digest = the same layer, reused
  local before after sizes i=0 same total
  before=$("$ENGINE" image inspect --format '{{range .RootFS.Layers}}{{println .}}{{end}}' "$image")
  after=$("$ENGINE" image inspect --format '{{range .RootFS.Layers}}{{println .}}{{end}}' "$IMAGE")
  sizes=$("$ENGINE" history --format '{{.Size}} {{.CreatedBy}}' "$IMAGE" \
    | grep -v '#(nop) \(ENV\|USER\|WORKDIR\|VOLUME\|EXPOSE\|HEALTHCHECK\|ENTRYPOINT\|CMD\|SHELL\)' | tac | cut -c1-90)
  while read -r layer; do
    i=$((i + 1))
    if [ "$layer" = "$(sed -n "${i}p" <<<"$before")" ]; then printf 'same layer  '; else printf 'new layer   '; fi
    printf '%s  %s\n' "${layer:7:12}" "$(sed -n "${i}p" <<<"$sizes")"
  done <<<"$after" >"$LOGS/layers.txt"
  cat "$LOGS/layers.txt"
  "$ENGINE" rmi "$IMAGE" >/dev/null; rm -rf "$tmp"
  same=$(grep -c '^same' "$LOGS/layers.txt"); total=$(wc -l <"$LOGS/layers.txt")
  [ "$same" -eq $((total - 1)) ] || die "only $same of $total runtime layers reused"
  say "rebuild after a change to service/: $(grep -c '^cached' "$LOGS/steps.txt") steps cached, $(grep -c '^BUILT' "$LOGS/steps.txt") built; $same of $total runtime layers the same (only the project's is new)"
}

case "${1:-}" in
  build) build ;;
  smoke) smoke ;;
  rebuild-check) rebuild_check ;;
  *) echo "usage: deploy/image.sh build|smoke|rebuild-check   (VARIANT=cpu|cuda)" >&2; exit 2 ;;
esac
