#!/usr/bin/env bash
# For a GPU host without network access: the Python wheels it needs beside its image's torch and
# transformers, downloaded here into .whl (git-ignored; copied to the host with the tree, where
# scripts/gpu_check.sh installs them): the kvsparse package (its stubs built here) and the grpcio,
# protobuf, health-checking and ml_dtypes versions the stubs need, for the host's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl
for spec in grpcio==1.85.1 protobuf==7.36.2 grpcio-health-checking==1.85.1 ml_dtypes==0.6.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
"$PY" -m pip wheel -q --no-deps -w .whl ./client/python
ls -la .whl
