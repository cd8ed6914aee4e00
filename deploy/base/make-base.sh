#!/usr/bin/env bash
# Makes the base image `localhost/wcodec-base:12` (Debian 12, python3, python3-venv, libgomp1,
# ca-certificates) with debootstrap, for machines that cannot pull `debian:bookworm-slim` from a
# registry. Needs root, debootstrap and podman (apt-get install debootstrap podman runc).
#
#   deploy/base/make-base.sh                 # the mirror of /etc/apt/sources.list*, else deb.debian.org
#   MIRROR=http://ftp.de.debian.org/debian deploy/base/make-base.sh
#
# Then build with `--build-arg BASE_IMAGE=localhost/wcodec-base:12` (deploy/image.sh does that
# when this image exists). A second run with the image present does nothing; FORCE=1 remakes it.
set -euo pipefail
IMAGE=${BASE_IMAGE:-localhost/wcodec-base:12}
SUITE=bookworm
PACKAGES=python3,python3-venv,libgomp1,ca-certificates

if [ "${FORCE:-0}" != 1 ] && podman image exists "$IMAGE"; then
  echo "base: $IMAGE exists (FORCE=1 remakes it)"; exit 0
fi
if [ -z "${MIRROR:-}" ]; then
  # the first Debian archive the host's apt uses: deb822 (*.sources) or one-line (*.list)
  MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
    | grep -oE '(https?://[^ ]+/debian)/?( |$)' | head -n1 | tr -d ' ' || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
ROOTFS=$(mktemp -d /var/tmp/wcodec-base.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
start=$(date +%s)
echo "base: debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
  || { tail -n 30 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"
# what an upstream slim image also leaves out: apt lists, caches, docs
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
  "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/*
printf 'deb %s %s main\ndeb %s %s-updates main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" >"$ROOTFS/etc/apt/sources.list"
tar --numeric-owner -C "$ROOTFS" -c . | podman import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' --message "debootstrap --variant=minbase $SUITE $MIRROR" - "$IMAGE" >/dev/null
echo "base: $IMAGE in $(( $(date +%s) - start )) s, $(podman image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=si)B"
