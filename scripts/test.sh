#!/usr/bin/env bash
# The whole CPU test suite: ruff, then pytest (Triton kernels run through the interpreter).
# GPU tests (marker `gpu`) are deselected here; run them on a GPU with `pytest -m gpu tests/kernels`.
# Tests marked `serial` start their own distributed worker groups; they run alone, after the rest. The rest run
# on 2 workers that steal from each other (`--dist worksteal`), so neither idles while the other has a queue.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh test
venv=${TIGON_VENV:-.venv}
# A test process or worker that aborts prints every thread's Python stack (the tests show its stderr).
export PYTHONFAULTHANDLER=1
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/python" -m pytest -m "not gpu and not serial" -n 2 --dist worksteal -q --ignore=tests/compat "$@"
"$venv/bin/python" -m pytest -m "serial" -q --ignore=tests/compat "$@"
# The patching tests again, against the older transformers line (4.5x) that users still run.
compat=${TIGON_TRANSFORMERS4:-.transformers4}
if [ ! -d "$compat/transformers" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$compat" \
    -r tests/compat/transformers4.txt 2> >(grep -v "is ignored" >&2)
fi
PYTHONPATH="$compat" "$venv/bin/python" -m pytest -m "not gpu and not serial" -n 2 -q tests/compat "$@"
