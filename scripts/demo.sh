#!/usr/bin/env bash
# The main job: the Flyte fine-tune workflow on the demo config, executed locally by flytekit.
# A tiny Llama learns two-digit addition with 2 worker processes (torch elastic over gloo), the
# tigon kernels applied; the run directory gets metrics, a loss curve, a report and the model.
# Extra arguments go to the workflow, e.g. `bash scripts/demo.sh --steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh platform
venv=${TIGON_VENV:-.venv}
"$venv/bin/pyflyte" run workflows/finetune.py finetune --run_dir runs/demo "$@"
