#!/usr/bin/env bash
# Entrypoint of the tigon image: in training pods, warm the Triton kernels into TRITON_CACHE_DIR; then exec the
# command (pyflyte-execute, torchrun, ...), so it runs as PID 1's child with the container's signals.
#
#   TIGON_WARMUP=1               warm up first; the train pods tigon creates (Flyte train tasks, render-job
#                                PyTorchJobs) set it. Unset or 0: no warm-up (validate, prepare_data and report
#                                run no kernels)
#   TIGON_WARMUP_ARGS="..."      arguments of `python -m tigon.kernels.warmup`, the job's sizes, e.g.
#                                "--hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256"
#                                or "--model-config /models/llama/config.json"
#   TIGON_WARMUP_STRICT=1        fail the container when the warm-up fails; by default it logs the
#                                failure and goes on (the kernels then compile on first use)
set -euo pipefail

if [[ "${TIGON_WARMUP:-0}" == "1" ]]; then
  read -r -a warmup_args <<< "${TIGON_WARMUP_ARGS:---hidden 4096}"
  started=$(date +%s)
  if python -m tigon.kernels.warmup "${warmup_args[@]}"; then
    echo "tigon-entrypoint: kernel warm-up done in $(( $(date +%s) - started )) s (cache ${TRITON_CACHE_DIR:-default})" >&2
  elif [[ "${TIGON_WARMUP_STRICT:-0}" == "1" ]]; then
    echo "tigon-entrypoint: kernel warm-up failed and TIGON_WARMUP_STRICT=1: stopping" >&2
    exit 1
  else
    echo "tigon-entrypoint: kernel warm-up failed; continuing (kernels compile on first use)" >&2
  fi
fi

if [[ $# -eq 0 ]]; then
  echo "tigon-entrypoint: no command given" >&2
  exit 2
fi
exec "$@"
