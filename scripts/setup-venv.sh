#!/usr/bin/env bash
# Create .venv (or $TIGON_VENV) if missing and install tigon with the given extras, e.g. `test` or `hf`.
# torch is pinned to 2.13.0: on a CPU machine that is the CPU build; elsewhere pip picks the usual build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TIGON_VENV:-.venv}
extras=${1:-test}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip
"$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2> >(grep -v "is ignored" >&2)
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]" 2> >(grep -v "is ignored" >&2)
# The deepspeed extra: DeepSpeed JIT-builds a small CPU communication op and CPU Adam (ZeRO-Offload) with g++ and ninja
# on first use. Build them here, once (cached in ~/.cache/torch_extensions), so no DeepSpeed run or test pays for it.
if "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('deepspeed') is None)"; then
  "$venv/bin/python" -m tigon.runtime.deepspeed_engine
fi
