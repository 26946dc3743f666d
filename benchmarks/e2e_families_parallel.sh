#!/usr/bin/env bash
# The per-family benchmark (benchmarks/end_to_end.py, as `gpu_run.sh e2e-families` runs it) on several GPUs at
# once: one list of families per GPU, each list in its own process on its own GPU, so a 4-GPU machine runs four
# lists in the time of one. Results under $OUT: e2e-<families>.json / .md / .log per list; join them with
# `python -m benchmarks.end_to_end --merge`.
#
#   LISTS="qwen2_vl,qwen2_5_vl llava,paligemma mllama,llama4 gemma4" E2E_BUDGET=300 bash benchmarks/e2e_families_parallel.sh
#   TF_SITE=/tmp/site-tf TF_LISTS="gemma4,gemma4_text" ...   # lists run with another transformers ahead of the image's
#   TINY=1 LISTS="llava qwen2_vl" E2E_VARIANTS=eager,tigon E2E_BUDGET=120 bash benchmarks/e2e_families_parallel.sh  # CPU
#
# E2E_VARIANTS (default eager,liger,tigon) and E2E_BUDGET (seconds per list) as for gpu_run.sh. Run from the
# repository root.
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-bench-out}
mkdir -p "$out"
source benchmarks/python_path.sh
variants=${E2E_VARIANTS:-eager,liger,tigon}
gpu=0
for families in ${LISTS:-} ${TF_LISTS:-}; do
  prefix=""
  if [[ " ${TF_LISTS:-} " == *" $families "* ]]; then prefix="${TF_SITE:?TF_SITE names the site directory of TF_LISTS}:"; fi
  name=e2e-${families//,/-}
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH="$prefix$PYTHONPATH" python3 -m benchmarks.end_to_end --family "$families" \
    --variants "$variants" --seqs 4096 --micro-batch 4 --warmup 1 --steps 2 --time-budget "${E2E_BUDGET:-300}" \
    ${TINY:+--tiny} --out "$out/$name.json" > "$out/$name.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
for log in "$out"/e2e-*.log; do tail -n 2 "$log"; done
