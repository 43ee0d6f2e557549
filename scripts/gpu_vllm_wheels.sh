#!/usr/bin/env bash
# vLLM's CUDA build for a GPU host without network access, in parts small enough to copy one per
# command. Run here (where PyPI is reachable); the host installs them with
# scripts/gpu_vllm_install.sh.
#
# The host's image has torch 2.11.0 (CUDA 13), torchvision 0.26.0, torchaudio 2.11.0 and
# transformers 5.17: exactly what vllm 0.24.0 pins, so only vLLM and the requirements the image
# lacks travel. The list below is what `import vllm` and the offline engine
# (vllm.entrypoints.llm, vllm.v1.engine.core, the V1/V2 GPU model runners, the FlashAttention
# backend, vllm.entrypoints.openai.api_server for `vllm serve`) import, found by importing them in
# a virtual environment holding only the image's packages and adding what each ImportError
# named; vLLM's other requirements (FlashInfer, CUTLASS DSL, TileLang, the OpenTelemetry exporters,
# MCP, Anthropic's client, ...) are imported lazily by features a dense Llama-family model with
# FlashAttention does not use, and stay behind. Versions are those the resolver picked with vLLM's
# pins (fastapi < 0.137, llguidance < 1.8, apache-tvm-ffi 0.1.9) for Python 3.12.
#
# Writes .vllm/parts/wheels.tar.part-NN (git-ignored), each at most PART_MB (default 36) MiB, and
# .vllm/parts/MANIFEST: the parts' names and the whole archive's SHA-256. Copy MANIFEST with each
# part. Usage: scripts/gpu_vllm_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PART_MB=${PART_MB:-36}  # a part and the tracked tree (22 MB) under a command's 64 MiB
WHEELS=(
  vllm==0.24.0
  annotated-types==0.8.0 apache-tvm-ffi==0.1.9 cachetools==8.0.2 cbor2==6.3.0 distro==1.9.0
  fastapi==0.136.3 httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 jmespath==1.1.0
  llguidance==1.7.6 model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai==2.54.0
  openai-harmony==0.0.8 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4
  pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 supervisor==4.3.0
  truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.3
)
dir=.vllm/wheels
mkdir -p "$dir"
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  ls "$dir" | grep -qi "^${name//-/[-_]}-${spec##*==}-" && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$spec"
done
rm -rf .vllm/parts && mkdir -p .vllm/parts
tar -cf .vllm/wheels.tar -C "$dir" .
split -b "${PART_MB}M" -d .vllm/wheels.tar .vllm/parts/wheels.tar.part-
{ echo "sha256 $(sha256sum .vllm/wheels.tar | cut -d' ' -f1)"; (cd .vllm/parts && ls wheels.tar.part-*); } \
  > .vllm/parts/MANIFEST
rm .vllm/wheels.tar
ls -la .vllm/parts
