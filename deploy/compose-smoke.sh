#!/usr/bin/env bash
# The compose stack, checked end to end (`make compose-smoke`): the wcodec image of deploy/image.sh
# (VARIANT, default cpu) and Prometheus from deploy/docker-compose.yml, with deploy/prometheus's
# config; Prometheus must scrape the server: up{job="wcodec"} == 1 and wcodec_ series, through its
# HTTP API. Grafana is not started (no Grafana build is installable here; tests/deploy validates
# its provisioning). ENGINE as deploy/image.sh; PROMETHEUS_IMAGE: default prom/prometheus where a
# docker daemon answers, else localhost/wcodec-prometheus:12 built from Debian's package.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${VARIANT:-cpu}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
export WCODEC_IMAGE=${WCODEC_IMAGE:-wcodec:${VERSION}-${VARIANT}}
export WCODEC_HOST_PORT=${WCODEC_HOST_PORT:-18000} PROMETHEUS_HOST_PORT=${PROMETHEUS_HOST_PORT:-19090}
PROJECT=wcodec-smoke
say() { printf '%s\n' "compose: $*"; }
die() { printf '%s\n' "compose: FAILED: $*" >&2; exit 1; }

VARIANT=$VARIANT IMAGE=$WCODEC_IMAGE deploy/image.sh build
if [ -z "${ENGINE:-}" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
if [ "$ENGINE" = docker ]; then
  COMPOSE=(docker compose)
else
  COMPOSE=(podman-compose)
  command -v podman-compose >/dev/null || die "podman-compose is not installed (apt-get install podman-compose)"
  if [ -z "${CONTAINERS_CONF:-}" ] && command -v runc >/dev/null; then export CONTAINERS_CONF=$PWD/deploy/podman/containers.conf; fi
  if [ -z "${PROMETHEUS_IMAGE:-}" ]; then
    export PROMETHEUS_IMAGE=localhost/wcodec-prometheus:12
    nice podman build -q --format docker --isolation chroot --build-arg "BASE_IMAGE=${BASE_IMAGE:-localhost/wcodec-base:12}" \
      -t "$PROMETHEUS_IMAGE" deploy/prometheus-image >/dev/null
    say "built $PROMETHEUS_IMAGE: $(podman run --rm "$PROMETHEUS_IMAGE" --version 2>&1 | head -n 1)"
  fi
fi
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f deploy/docker-compose.yml "$@"; }
trap 'compose down -v >/dev/null 2>&1 || true' EXIT
compose up -d wcodec prometheus >/tmp/wcodec-compose-up.log 2>&1 || { tail -n 20 /tmp/wcodec-compose-up.log >&2; die "up"; }
say "up: $WCODEC_IMAGE on 127.0.0.1:$WCODEC_HOST_PORT, ${PROMETHEUS_IMAGE:-prom/prometheus} on 127.0.0.1:$PROMETHEUS_HOST_PORT"

query() {
  curl -fsS --max-time 10 -G "http://127.0.0.1:$PROMETHEUS_HOST_PORT/api/v1/query" --data-urlencode "query=$1"
}
value() { python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")'; }
start=$SECONDS
until [ "$(query 'up{job="wcodec"}' 2>/dev/null | value 2>/dev/null)" = 1 ]; do
  [ $((SECONDS - start)) -lt 300 ] || { compose logs >&2 || true; die 'up{job="wcodec"} is not 1 after 300 s'; }
  sleep 3
done
say "Prometheus: up{job=\"wcodec\"} == 1 after $((SECONDS - start)) s: $(query 'up{job="wcodec"}')"
# one answered request, then its counter through Prometheus (the scrape interval is 15 s)
until curl -fsS --max-time 5 "http://127.0.0.1:$WCODEC_HOST_PORT/health/ready" >/dev/null 2>&1; do
  [ $((SECONDS - start)) -lt 600 ] || die "wcodec is not ready"
  sleep 3
done
curl -fsS --max-time 120 "http://127.0.0.1:$WCODEC_HOST_PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20, "temperature": 0}' | grep -q Paris \
  || die "the chat answer names no Paris"
asked=$SECONDS
until [ "$(query 'sum(wcodec_generate_requests_total{job="wcodec"})' 2>/dev/null | value 2>/dev/null)" = 1 ]; do
  [ $((SECONDS - asked)) -lt 60 ] || die "Prometheus has no wcodec_generate_requests_total after a request"
  sleep 3
done
say "Prometheus: after one chat request: $(query 'wcodec_generate_requests_total{job="wcodec"} > 0' \
  | python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"][0]; print(r["metric"], r["value"])')"
series=$(query 'count by (__name__) ({job="wcodec", __name__=~"wcodec_.+"})' \
  | python3 -c 'import json, sys; print(" ".join(sorted(r["metric"]["__name__"] for r in json.load(sys.stdin)["data"]["result"])))')
[ -n "$series" ] || die "Prometheus holds no wcodec_ series"
say "Prometheus: $(wc -w <<<"$series") wcodec_ metric names scraped, e.g. $(cut -d' ' -f1-6 <<<"$series")"
say PASSED
