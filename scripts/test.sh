#!/usr/bin/env bash
# The whole CPU test suite: ruff, then pytest (Triton kernels run through the interpreter).
# `--quick` runs ruff and the sample of every layer listed in tests/quick.txt instead: a few minutes on 2 cores.
# GPU tests (marker `gpu`) are deselected here; run them on a GPU with `pytest -m gpu tests/kernels`.
# Tests marked `serial` start their own distributed worker groups; they run alone, after the rest. The rest run
# on 2 workers that steal from each other (`--dist worksteal`), so neither idles while the other has a queue.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TIGON_VENV:-.venv}
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
# The quick tier sets the environment up only when it is missing; the full suite always brings it up to date.
if [ "$quick" = 0 ] || [ ! -x "$venv/bin/ruff" ]; then
  bash scripts/setup-venv.sh test
fi
# A test process or worker that aborts prints every thread's Python stack (the tests show its stderr).
export PYTHONFAULTHANDLER=1
# One torch (OpenMP) thread per process: two pytest workers, and the worker groups tests start, already fill the
# cores; a second thread per process contends with the others' (tiny-model tests ran 1.4x to 1.9x faster with one).
export OMP_NUM_THREADS=1
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
if [ "$quick" = 1 ]; then
  mapfile -t sample < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' tests/quick.txt)
  exec "$venv/bin/python" -m pytest -m "not gpu" -n 2 --dist worksteal -q "${sample[@]}" "$@"
fi
"$venv/bin/python" -m pytest -m "not gpu and not serial" -n 2 --dist worksteal -q --durations=15 --ignore=tests/compat "$@"
"$venv/bin/python" -m pytest -m "serial" -q --ignore=tests/compat "$@"
# The patching tests again, against the older transformers line (4.5x) that users still run.
compat=${TIGON_TRANSFORMERS4:-.transformers4}
if [ ! -d "$compat/transformers" ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$compat" \
    -r tests/compat/transformers4.txt 2> >(grep -v "is ignored" >&2)
fi
PYTHONPATH="$compat" "$venv/bin/python" -m pytest -m "not gpu and not serial" -n 2 -q tests/compat "$@"
