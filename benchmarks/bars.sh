#!/usr/bin/env bash
# tigon against HF + Liger-Kernel's fastest setting, in one command: instruction data (documents of mixed lengths,
# half of each a prompt, packed) at the Llama-3-8B shape; HF + Liger-Kernel with flex attention and nothing
# recomputed at the largest micro-batch of MICROS (8 4 2) dividing MICRO_BATCH that fits (accumulating to it), then
# tigon's planner in bf16 (exact) and in FP8 (compiled layers), each paired with it step by step
# (`benchmarks/headline.py paired`). Every run lands under $OUT/headline (benchmarks/headline.sh); the pairs are
# printed and written to $OUT/headline/bars.txt.
#
#   GPUS=4 bash benchmarks/bars.sh                  # FSDP2 over 4 GPUs
#   GPUS=1 bash benchmarks/bars.sh                  # one GPU: the plain model (parallelism.strategy: ddp)
#   FP8=0 SHAPE=llama-3.2-1b bash benchmarks/bars.sh   # exact only, the Llama-3.2-1B shape
#   MICROS="4 2" GPUS=4 bash benchmarks/bars.sh     # skip a micro-batch known not to fit
#   FP8_LAYERS="auto tigon" GPUS=4 bash benchmarks/bars.sh   # FP8 twice: the default layers (torchao's under FSDP2,
#                                                   # with FP8 all-gathers) and tigon's (bf16 all-gathers)
#   TINY=1 GPUS=2 SEQ=1024 STEPS=5 MICRO_BATCH=2 BASE=eager SETS="model.attn_implementation=sdpa \
#     training.compile_backend=aot_eager" TIGON_FP8_EMULATE=1 bash benchmarks/bars.sh   # CPU smoke run
#
# SETS (KEY=VALUE config overrides) apply to every run, after this script's own; LIMIT bounds each run's seconds.
set -uo pipefail
export GPUS=${GPUS:-$(nvidia-smi --list-gpus 2> /dev/null | wc -l)}
export SEQS=${SEQ:-4096} STEPS=${STEPS:-16} MICRO_BATCH=${MICRO_BATCH:-8} DOCS=${DOCS:-instruction}
BASE=${BASE:-liger}  # the variant tigon is measured against
MICROS=${MICROS:-"8 4 2"}  # the base's micro-batches to try, largest first
FP8=${FP8:-1}
FP8_LAYERS=${FP8_LAYERS:-auto}  # training.fp8_layers of the FP8 runs, one run each
out=${OUT:-bench-out}/headline
if [[ "$GPUS" == 1 ]]; then strategy=ddp; else strategy=fsdp; fi
extra=${SETS:-}

run() {  # run TAG VARIANT SETTINGS...
  local tag=$1 variant=$2
  shift 2
  TAG=$tag VARIANTS=$variant SETS="parallelism.strategy=$strategy $* $extra" bash benchmarks/headline.sh
}

base=
for micro in $MICROS; do
  if ((micro > MICRO_BATCH || MICRO_BATCH % micro)); then continue; fi  # micro x accumulation = MICRO_BATCH
  run "bars$micro" "$BASE" training.gradient_checkpointing=false model.attn_implementation=flex_attention \
    "training.micro_batch_size=$micro" "training.gradient_accumulation_steps=$((MICRO_BATCH / micro))"
  name=$BASE-bars$micro-$SEQS
  if grep -qi "out of memory" "$out/$name.log"; then continue; fi
  if [[ ! -s $out/$name/metrics.jsonl ]]; then
    echo "$name failed (not for memory): see $out/$name.log"
    exit 1
  fi
  base=$name
  break
done
if [[ -z $base ]]; then
  echo "$BASE fit at no micro-batch of MICROS=\"$MICROS\" dividing MICRO_BATCH=$MICRO_BATCH: nothing to measure" \
    "against; try smaller ones (MICROS)"
  exit 1
fi
run bars planner
others=("planner-bars-$SEQS")
if [[ "$FP8" == 1 ]]; then
  for layers in $FP8_LAYERS; do
    tag=bars-fp8
    if [[ "$layers" != auto ]]; then tag=bars-fp8-$layers; fi
    run "$tag" planner-compiled training.precision=fp8 "training.fp8_layers=$layers"
    others+=("planner-compiled-$tag-$SEQS")
  done
fi
for other in "${others[@]}"; do
  python3 -m benchmarks.headline paired --out "$out" "$base" "$other" || exit 1
done | tee "$out/bars.txt"
