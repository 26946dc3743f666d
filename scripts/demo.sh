#!/usr/bin/env bash
# The main job for now: a short kernel demo on a small Llama (GPU: speed-up and memory; CPU: reference path).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh hf
venv=${TIGON_VENV:-.venv}
"$venv/bin/python" -m tigon.kernels.demo "$@"
