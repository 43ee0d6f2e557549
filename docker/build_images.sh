#!/usr/bin/env bash
# Builds kvsparse (runtime) and kvsparse-cuda (runtime-cuda) from docker/Dockerfile with podman
# (daemonless), from the repository root. BINARIES=prebuilt (default) copies build/bin/ of this
# checkout, stripped of debug info; BINARIES=compile builds from source in the compile stage.
#   bash docker/build_base.sh && bash docker/build_images.sh
# PODMAN may carry global options, e.g. PODMAN="podman --runtime runc" where crun cannot run.
# BUILD_FLAGS adds podman build options (e.g. the --ulimit ones a sandbox needs).
set -euo pipefail
cd "$(dirname "$0")/.."
PODMAN=${PODMAN:-podman}
BINARIES=${BINARIES:-prebuilt}
TAG=${TAG:-dev}
BASE_IMAGE=${BASE_IMAGE:-localhost/kvsparse-base:bookworm}
revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$BINARIES" = prebuilt ]; then
  # The image takes copies without debug info (a RelWithDebInfo kvsparse-server is ~48 MB, ~18
  # stripped); build/bin/ keeps its symbols for gdb and perf here.
  mkdir -p build/image/bin
  for b in kvsparse-server kvsparse; do
    [ -x "build/bin/$b" ] || { echo "build/bin/$b is missing: build first (scripts/build.sh)"; exit 1; }
    strip --strip-debug -o "build/image/bin/$b" "build/bin/$b"
  done
fi
for target in runtime runtime-cuda; do
  name=localhost/kvsparse; [ "$target" = runtime-cuda ] && name=localhost/kvsparse-cuda
  # --format docker keeps HEALTHCHECK (the OCI image format has no field for it).
  # shellcheck disable=SC2086
  $PODMAN build --format docker --network host --ignorefile docker/dockerignore \
    -f docker/Dockerfile --target "$target" \
    --build-arg BASE="$BASE_IMAGE" --build-arg BINARIES="$BINARIES" \
    --build-arg VERSION="$TAG" --build-arg REVISION="$revision" \
    ${BUILD_FLAGS:-} -t "$name:$TAG" .
done
$PODMAN images --filter reference='localhost/kvsparse*'
