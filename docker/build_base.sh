#!/usr/bin/env bash
# The images' base without a registry: a Debian 12 minbase rootfs made by mmdebstrap from Debian's
# mirror, imported as $BASE_IMAGE (default localhost/kvsparse-base:bookworm) into podman's store.
#   apt-get install -y mmdebstrap podman buildah runc   (Debian 12)
set -euo pipefail
BASE_IMAGE=${BASE_IMAGE:-localhost/kvsparse-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}
PODMAN=${PODMAN:-podman}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mmdebstrap --variant=minbase --include=ca-certificates bookworm "$tmp/rootfs.tar" \
  "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
  "deb $SECURITY bookworm-security main"
$PODMAN import --change 'CMD ["/bin/bash"]' \
  --change 'LABEL org.opencontainers.image.description="Debian 12 minbase (mmdebstrap)"' \
  "$tmp/rootfs.tar" "$BASE_IMAGE"
echo "build_base: $BASE_IMAGE"
