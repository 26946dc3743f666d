#!/usr/bin/env bash
# The whole CPU test suite: ruff, then pytest (Triton kernels run through the interpreter).
# GPU tests (marker `gpu`) are deselected here; run them on a GPU with `pytest -m gpu tests/kernels`.
# Tests marked `serial` start their own distributed worker groups; they run alone, after the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh test
venv=${TIGON_VENV:-.venv}
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/python" -m pytest -m "not gpu and not serial" -n 2 -q "$@"
"$venv/bin/python" -m pytest -m "serial" -q "$@"
