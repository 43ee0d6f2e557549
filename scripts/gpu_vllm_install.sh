#!/usr/bin/env bash
# On a GPU host without network access: vLLM's CUDA build from the parts scripts/gpu_vllm_wheels.sh
# wrote, brought over one or more per command. Each run moves the parts present under
# .vllm/parts (beside their MANIFEST) into $PARTS (default /tmp/vllm-parts, which must outlive
# the commands: on a host that is wiped between commands the parts cannot accumulate); once every
# part the manifest names is there, it checks the archive's SHA-256, installs the wheels into
# $SITE (default /tmp/vllm-site, no dependencies resolved: the list is complete beside the
# image's packages) and checks that vLLM imports. Prints "vllm: N of M parts" or "vllm: ready";
# exits 0 in both cases and non-zero on a bad archive or a failed install or import. Use:
#   bash scripts/gpu_vllm_install.sh && export PYTHONPATH=/tmp/vllm-site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${PARTS:-/tmp/vllm-parts}
SITE=${SITE:-/tmp/vllm-site}
PY=${PY:-python3}
check() {
  PYTHONPATH="$SITE:${PYTHONPATH:-}" "$PY" -c \
    "import vllm, torch; from vllm import LLM; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}
if [ -f "$SITE/.complete" ]; then
  check && echo "vllm: ready" && exit 0
fi
mkdir -p "$PARTS"
if [ -d .vllm/parts ]; then
  cp .vllm/parts/MANIFEST "$PARTS/" 2>/dev/null || true
  for p in .vllm/parts/wheels.tar.part-*; do
    [ -f "$p" ] && cp "$p" "$PARTS/"
  done
fi
[ -f "$PARTS/MANIFEST" ] || { echo "vllm: no MANIFEST yet (copy .vllm/parts/MANIFEST with a part)"; exit 0; }
want=$(tail -n +2 "$PARTS/MANIFEST")
have=0 total=0
for p in $want; do
  total=$((total + 1))
  [ -f "$PARTS/$p" ] && have=$((have + 1))
done
if [ "$have" -lt "$total" ]; then
  echo "vllm: $have of $total parts"
  exit 0
fi
sum=$(cd "$PARTS" && cat $want | sha256sum | cut -d' ' -f1)
expected=$(head -1 "$PARTS/MANIFEST" | cut -d' ' -f2)
if [ "$sum" != "$expected" ]; then
  echo "vllm: the parts' SHA-256 is $sum, the manifest says $expected" >&2
  exit 1
fi
rm -rf "$PARTS/wheels" && mkdir -p "$PARTS/wheels"
(cd "$PARTS" && cat $want | tar -xf - -C wheels)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$PARTS"/wheels/*.whl
rm -rf "$PARTS"
check
touch "$SITE/.complete"
echo "vllm: ready"
