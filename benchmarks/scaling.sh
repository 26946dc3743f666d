#!/usr/bin/env bash
# Scaling: tokens/s per GPU at 1, 2 and 4 GPUs (GPU_COUNTS) for DDP, FSDP2 and DeepSpeed ZeRO-3 (STRATEGIES: ddp,
# fsdp, zero1, zero2, zero3), one
# `tigon train` under torchrun per point: the Llama-3.2-1B config (random init; SHAPE=llama-3-8b for the 8B),
# bf16, AdamW, kernels on, gradient checkpointing on, micro-batch 8 per GPU (the global batch grows with the
# GPUs), sequence 4096. Results under $OUT/scaling: a directory per strategy and GPU count, then scaling.json
# and scaling.md (benchmarks/headline.py scaling: efficiency = N-GPU tokens/s / (N x 1-GPU tokens/s), and the
# planner's estimate beside rank 0's measured peak).
#
#   bash benchmarks/scaling.sh
#   STRATEGIES="fsdp" GPU_COUNTS="2 4" SHAPE=llama-3-8b MICRO_BATCH=2 bash benchmarks/scaling.sh
#   STRATEGIES="zero1 zero2" GPU_COUNTS="1 2" STEPS=6 bash benchmarks/scaling.sh   # the planner's ZeRO-1/2 terms
#   TINY=1 GPU_COUNTS="1 2" SEQ=32 STEPS=5 MICRO_BATCH=2 bash benchmarks/scaling.sh      # CPU smoke run
#
# Run from the repository root.
set -uo pipefail
export PYTHONUNBUFFERED=1
STRATEGIES=${STRATEGIES:-"ddp fsdp zero3"}
GPU_COUNTS=${GPU_COUNTS:-"1 2 4"}
SHAPE=${SHAPE:-llama-3.2-1b}
SEQ=${SEQ:-4096}
STEPS=${STEPS:-8}
MICRO_BATCH=${MICRO_BATCH:-8}
TINY=${TINY:-}
LIMIT=${LIMIT:-600}  # seconds per run
out=${OUT:-bench-out}/scaling
mkdir -p "$out"
source benchmarks/python_path.sh
if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"; fi

for strategy in $STRATEGIES; do
  for gpus in $GPU_COUNTS; do
    group="$out/$strategy-${gpus}gpu"
    config=$(python3 -m benchmarks.headline prepare --out "$group" --variant tigon --seq "$SEQ" --gpus "$gpus" \
      --steps "$STEPS" --micro-batch "$MICRO_BATCH" --shape "$SHAPE" --strategy "$strategy" ${TINY:+--tiny}) || exit 1
    echo "== $strategy on $gpus GPUs"
    timeout "$LIMIT" torchrun --standalone --nproc_per_node "$gpus" -m tigon.runtime train "$config" > "$group.log" 2>&1
    status=$?
    tail -n 2 "$group.log"
    echo "   exit $status"
  done
done
python3 -m benchmarks.headline scaling --out "$out" | tee "$out/scaling-table.txt"
