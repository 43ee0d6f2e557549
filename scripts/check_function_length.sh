#!/usr/bin/env bash
# Fails if a C++ function outside kernels/ or a Python function is longer than 120 lines
# (docs/DESIGN.md, "Conventions"; kernels/ is exempt, where splitting a device function can cost
# speed). Measured by lizard (PyPI, pinned below) in its own virtual environment, build/lint-venv
# by default (LINT_VENV), made on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LINT_VENV:-build/lint-venv}
if [ ! -x "$venv/bin/lizard" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q lizard==1.24.3
fi
# -L: the length limit; -C and -a so high that only length warns.
lizard=("$venv/bin/lizard" -L 120 -C 100000 -a 100 -w)
if "${lizard[@]}" -l cpp engine rpc server client kvstore op tests &&
   "${lizard[@]}" -l python client/python/kvsparse client/python/tests tests scripts; then
  echo "function length: OK (none over 120 lines outside kernels/, C++ and Python)"
else
  echo "function length: the functions above are over 120 lines; split them into named steps"
  exit 1
fi
