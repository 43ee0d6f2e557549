#!/usr/bin/env bash
# Exports an image's root filesystem as .carry/cimg/rootfs.tar.xz (git-ignored), small enough to
# travel to the GPU machine (which has no container runtime): docs, man pages and locales dropped,
# the binaries' debug info stripped. docker/run_rootfs_gpu.sh runs it there.
#   PODMAN="podman --runtime runc" BINARIES=prebuilt bash docker/build_images.sh   # CUDA build/bin
#   PODMAN="podman --runtime runc" bash docker/export_rootfs.sh [localhost/kvsparse-cuda:dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
IMAGE=${1:-localhost/kvsparse-cuda:dev}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; $PODMAN rm -f kvsparse-export >/dev/null 2>&1 || true' EXIT
$PODMAN create --name kvsparse-export "$IMAGE" >/dev/null
mkdir -p "$tmp/rootfs" .carry/cimg
$PODMAN export kvsparse-export | tar -x -C "$tmp/rootfs"
rm -rf "$tmp"/rootfs/usr/share/{doc,man,locale,info} "$tmp"/rootfs/var/cache/*
strip --strip-debug "$tmp"/rootfs/usr/local/bin/*
tar -C "$tmp" -cf - rootfs | xz -T2 -9 > .carry/cimg/rootfs.tar.xz
ls -la .carry/cimg/rootfs.tar.xz
