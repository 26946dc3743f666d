#!/usr/bin/env bash
# Steps that stall, traced from the host (benchmarks/stall_trace.py): the Llama-3.2-1B shape on instruction records
# (best-fit rows of 4096, micro-batch 8 a GPU, nothing recomputed, as benchmarks/headline.sh writes them) on GPUS
# GPUs (1 by default; FSDP2 over several), with training.freeze_gc on and off, each run on an empty Triton cache as
# a fresh pod has. Results under $OUT/stalls: each run's directory and log, every rank's trace and the run's
# summary (summary-RUN.json), which places every rank's collections and compiles in the steps.
#
#   bash benchmarks/stalls.sh
#   STEPS=100 RUNS=nofreeze bash benchmarks/stalls.sh
#   GPUS=4 STEPS=80 bash benchmarks/stalls.sh
#   TINY=1 SEQS=64 MICRO_BATCH=2 DOCS=full STEPS=6 bash benchmarks/stalls.sh   # CPU smoke run
#
# Run from the repository root.
set -uo pipefail
export PYTHONUNBUFFERED=1
SEQS=${SEQS:-4096}
GPUS=${GPUS:-1}
out=${OUT:-bench-out}/stalls
mkdir -p "$out"
source benchmarks/python_path.sh
for run in ${RUNS:-freeze nofreeze}; do
  sets=(--set training.gradient_checkpointing=false)
  if [[ $run == nofreeze ]]; then sets+=(--set training.freeze_gc=false); else sets+=(--set training.freeze_gc=true); fi
  config=$(python3 -m benchmarks.headline prepare --out "$out" --variant tigon --seq "$SEQS" --gpus "$GPUS" \
    --steps "${STEPS:-50}" --micro-batch "${MICRO_BATCH:-8}" --shape "${SHAPE:-llama-3.2-1b}" --tag "$run" \
    --documents "${DOCS:-instruction}" ${TINY:+--tiny} "${sets[@]}") || exit 1
  echo "== $run"
  TRITON_CACHE_DIR="$out/triton-$run" timeout "${LIMIT:-300}" torchrun --standalone --nproc_per_node "$GPUS" \
    -m benchmarks.stall_trace train "$config" --out "$out" --tag "$run" > "$out/$run.log" 2>&1
  echo "   exit $?"
  rm -rf "$out/triton-$run"
  traces=("$out/trace-$run-rank0.json")
  for ((rank = 1; rank < GPUS; rank++)); do traces+=("$out/trace-$run-rank$rank.json"); done
  python3 -m benchmarks.stall_trace report "${traces[@]}" "$out/tigon-$run-$SEQS/metrics.jsonl" \
    --json "$out/summary-$run.json"
done
