#!/usr/bin/env bash
# The headline run: Llama-3-8B (random init), bf16, AdamW, micro-batch 8 per GPU, gradient checkpointing on,
# FSDP2 over all GPUs through `tigon train` under torchrun; sequence 1K..16K; HF eager, HF + Liger-Kernel,
# tigon, and tigon with the planner (training.plan: auto). Results under $OUT/headline: one directory and log
# per run, then headline.json and headline.md (benchmarks/headline.py collect).
#
#   bash benchmarks/headline.sh                                        # every visible GPU, the full sweep
#   GPUS=2 LAYERS=8 bash benchmarks/headline.sh                        # 2 GPUs, model shortened to 8 layers
#   SHAPE=llama-3.2-1b GPUS=2 SEQS=4096 VARIANTS=tigon bash benchmarks/headline.sh   # the Llama-3.2-1B shape instead
#   SEQS="4096 8192" VARIANTS="liger tigon" bash benchmarks/headline.sh
#   MICRO_BATCH=1 SEQS="16384 32768" bash benchmarks/headline.sh       # the longest sequence at micro-batch 1
#   TINY=1 GPUS=2 SEQS=32 VARIANTS=tigon STEPS=5 MICRO_BATCH=2 bash benchmarks/headline.sh   # CPU smoke run
#   VARIANTS="tigon-compiled planner-compiled" bash benchmarks/headline.sh   # decoder layers compiled (training.compile)
#   TAG=ckpt10 SETS="training.checkpoint_layers=10" VARIANTS=tigon bash benchmarks/headline.sh   # config overrides
#   DOCS=mixed TAG=mixed SEQS=4096 VARIANTS="liger planner" bash benchmarks/headline.sh   # packed fine-tuning data
#   GPUS=1 TAG=one SETS=parallelism.strategy=ddp bash benchmarks/headline.sh   # one GPU, the plain model (FSDP2 over one process shards nothing)
#
# A variant that runs out of memory at one length is not run at longer ones. Run from the repository root.
set -uo pipefail
export PYTHONUNBUFFERED=1
GPUS=${GPUS:-$(nvidia-smi --list-gpus 2> /dev/null | wc -l)}
SEQS=${SEQS:-"1024 2048 4096 8192 16384"}
VARIANTS=${VARIANTS:-"eager liger tigon planner"}
STEPS=${STEPS:-12}
LAYERS=${LAYERS:-}
SHAPE=${SHAPE:-llama-3-8b}  # the model's config: llama-3-8b or llama-3.2-1b (random weights)
MICRO_BATCH=${MICRO_BATCH:-8}
TINY=${TINY:-}
SETS=${SETS:-}  # KEY=VALUE config overrides (space-separated), applied to every run of this sweep
TAG=${TAG:-}    # names the overridden runs apart: VARIANT-TAG-SEQ
DOCS=${DOCS:-full}  # full: one document a sequence; mixed: documents of 100-4000 characters packed; instruction: those split into prompt and response
LIMIT=${LIMIT:-1800}  # seconds per run
out=${OUT:-bench-out}/headline
mkdir -p "$out"
source benchmarks/python_path.sh
if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"; fi

declare -A stopped
for seq in $SEQS; do
  for variant in $VARIANTS; do
    name=$variant${TAG:+-$TAG}
    if [[ -n "${stopped[$variant]:-}" ]]; then
      echo "skip $variant at $seq (out of memory at ${stopped[$variant]})"
      continue
    fi
    config=$(python3 -m benchmarks.headline prepare --out "$out" --variant "$variant" --seq "$seq" --gpus "$GPUS" \
      --steps "$STEPS" --micro-batch "$MICRO_BATCH" --shape "$SHAPE" ${LAYERS:+--layers "$LAYERS"} ${TINY:+--tiny} ${TAG:+--tag "$TAG"} --documents "$DOCS" \
      $(for setting in $SETS; do printf -- '--set %s ' "$setting"; done)) || exit 1
    if [[ "$variant" == liger ]]; then entry=(-m benchmarks.headline liger-train "$config"); else entry=(-m tigon.runtime train "$config"); fi
    echo "== $name at seq $seq on $GPUS GPUs${SETS:+ ($SETS)}"
    timeout "$LIMIT" torchrun --standalone --nproc_per_node "$GPUS" "${entry[@]}" > "$out/$name-$seq.log" 2>&1
    status=$?
    if ((status == 124)); then echo "stopped at the time limit: LIMIT=$LIMIT s" >> "$out/$name-$seq.log"; fi
    tail -n 3 "$out/$name-$seq.log"
    if grep -qi "out of memory" "$out/$name-$seq.log"; then stopped[$variant]=$seq; fi
    echo "   exit $status"
  done
done
python3 -m benchmarks.headline collect --out "$out" | tee "$out/headline-table.txt"
