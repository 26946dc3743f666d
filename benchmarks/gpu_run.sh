#!/usr/bin/env bash
# Run on a GPU machine from the repository root: GPU tests, the demo, then benchmarks.
# Results land under $OUT. Usage: bash benchmarks/gpu_run.sh [tests] [packed] [attention] [demo] [tune] [bench] [bench-main] [bench-distill] [bench-sweeps] [host-overhead] [flce-traffic]
#   [compile (benchmarks/end_to_end.py with and without --compile: tokens/s and peak memory of HF eager and tigon, each
#   with its decoder layers eager and compiled; COMPILE_FAMILIES, default "llama qwen3" (Llama-3.2-1B, Qwen3-1.7B);
#   E2E_VARIANTS, E2E_SEQS (4096), E2E_MICRO (4), E2E_STEPS (5 timed steps))]
#   [fp8 (benchmarks/end_to_end.py --compile, tigon in bf16 and with --precision fp8: tokens/s and peak memory of the
#   Llama-3-8B shape on one GPU; E2E_SHAPE, E2E_SEQS (4096), E2E_MICRO (4))]
#   [fp8-loss (benchmarks/fp8_loss_curve.py: the demo task, widened to FP8_HIDDEN (1024) x FP8_LAYERS (4), trained
#   FP8_STEPS (600) steps in bf16 and in fp8 tensorwise and rowwise; the curves' relative difference; FP8_CORPUS=stdlib
#   trains on real text, FP8_CORPUS_MB of it; FP8_SEEDS, FP8_LR, FP8_MICRO: bf16's seeds, the learning rate, the batch)]
#   [planner-tests] [preference-memory (benchmarks/preference_memory.py: the planner's estimate against measured
#   peaks of DPO, KTO and ORPO runs, padded and packed pairs, frozen and precomputed reference)]
#   [adapter-tests (the HF Trainer and Lightning adapters on one GPU: strategies and objectives)] [multi-gpu-tests (4 GPUs: the three trainers
#   under DDP, FSDP2 and ZeRO-2/3 on 1, 2 and 4 GPUs, the alignment objectives, a killed rank, a failing rank; TEST_LIMIT seconds)] [scaling (benchmarks/scaling.sh)]
#   [recompute-curve (tokens/s against peak memory for each of RECOMPUTE_LAYERS: N layers checkpointed whole, sM selective,
#   N+sM both; and Liger-Kernel with checkpointing on and off; E2E_SHAPE=llama-3-8b, E2E_MICRO; E2E_TIGON_FLAGS="--compile
#   --precision fp8": tigon's runs compiled, in FP8)]
#   [e2e-qlora (Llama-3-8B QLoRA on one GPU: HF + peft, + Liger-Kernel, tigon, the planner; carry .whl-qlora: bitsandbytes, peft)]
#   [flyte-gpu (pyflyte run of the workflow on every GPU, a killed worker; carry .whl-flyte too)]
#   [trl (benchmarks/trl_integration.py: TRL's DPOTrainer and SFTTrainer alone, with Liger-Kernel and with use_tigon;
#   carry .whl-trl: trl, datasets, dill, multiprocess; .whl holds Liger-Kernel; TRL_TRAINERS=dpo runs DPO only)]
#   [headline (benchmarks/headline.sh)] (BENCH_LIMIT seconds each; results in $OUT/scaling.tgz, headline.tgz) [e2e] [e2e-8k] [e2e-longest] [e2e-families] [e2e-longest-families]   (end-to-end: benchmarks/end_to_end.py, one step per
#   device call; E2E_VARIANTS=eager,liger picks the variants of e2e-longest or e2e-families, to keep each call under the
#   device's 10 minutes; e2e-families runs every model family at seq 4096 within a 520 s budget and names the families
#   it did not reach: E2E_FAMILIES=gemma2,phi3 runs those in the next call; E2E_BUDGET sets its budget in seconds
#   (vision-language families run as their *ForConditionalGeneration on text; Gemma 4's need the transformers wheel of
#   .whl-tf/, carried beside .whl: see docs/benchmarks.md, "Per model family"); E2E_MICRO the micro-batch of e2e-longest, default 8;
#   e2e-longest-families searches each family's longest sequence at micro-batch 1, up to its context length, with the same
#   E2E_FAMILIES, E2E_VARIANTS and E2E_BUDGET); e2e-profile adds one profiled step per variant (time per kernel kind;
#   E2E_SEQS, E2E_VARIANTS); varlen runs cuDNN's ragged attention's GPU tests, then benchmarks/varlen_attention.py
#   (cuDNN's kernel against PyTorch's varlen flash on packed documents; carry .whl-cudnn/: nvidia-cudnn-frontend, whose
#   wheel also makes every other step's varlen attention cuDNN's); packed runs the packed-attention GPU tests, then benchmarks/packed_attention.py (real
#   tokens/s and peak memory on packed fine-tuning data: tigon varlen, flex and dense mask against HF + Liger-Kernel;
#   PACKED_BUDGET seconds, default 360); fp16-smoke trains the demo in fp16 with the torch, Lightning and HF
#   trainers under DDP and FSDP2 (one process) and prints the end of each run's log)
#   [checkpoint-scale (benchmarks/checkpoint_scale.py: FSDP2 on every local GPU, sync and async saves and resume;
#   CKPT_SHAPE=llama-3-8b (default) or llama-3.2-1b, CKPT_SEQ tokens per sequence, default 1024; CKPT_LIMIT seconds,
#   default 480; the checkpoints go to CKPT_RUN_DIR, default a temporary directory, which needs room for one)]
#   [distill-smoke trains the demo as a
#   teacher (TEACHER_STEPS, 150), then examples/distill.yaml and the DPO and KTO examples in bf16 for DISTILL_STEPS (50)
#   under DDP and FSDP2 (DISTILL_RUNS=objective:strategy ..., strategy ddp, fsdp or zero3 for DeepSpeed ZeRO-3) on the
#   GPU's kernels, in DISTILL_NPROC processes (1; more through torchrun, one GPU each), and prints each loss]
#   [convergence] (every table family against float64 at real widths) [patching] (the CPU patching and fused-loss
#   tests against this machine's transformers); FAMILIES_K, a pytest -k expression such as "smollm3 or gpt_oss",
#   picks the families of either
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-bench-out}
mkdir -p "$out"
source benchmarks/python_path.sh
python3 -c "import pydantic, yaml" 2> /dev/null \
  || echo "the runtime needs pydantic and pyyaml here: carry their wheels in .whl (see the device tool's README)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
for step in "$@"; do
  case "$step" in
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels > "$out/gpu-tests.log" 2>&1; tail -n 40 "$out/gpu-tests.log" ;;
    attention) python3 -m benchmarks.attention_backends --out "$out/attention.json" 2>&1 | tee "$out/attention.log" ;;
    demo) python3 -m tigon.kernels.demo --steps 5 2>&1 | tee "$out/demo.log" ;;
    tune-flce) python3 -m benchmarks.tune_fused_linear_cross_entropy 2>&1 | tee "$out/tune-flce.log" ;;
    flce-time-memory) python3 -m benchmarks.tune_fused_linear_cross_entropy --time-memory "$out/flce-time-memory.png" 2>&1 | tee "$out/flce-time-memory.log" ;;
    flce-traffic) python3 -m benchmarks.tune_fused_linear_cross_entropy --traffic-bound 2>&1 | tee "$out/flce-traffic.log" ;;
    host-overhead) python3 -m benchmarks.host_overhead --out "$out/host-overhead.json" 2>&1 | tee "$out/host-overhead.log" ;;
    tune-preference) python3 -m benchmarks.tune_fused_linear_preference 2>&1 | tee "$out/tune-preference.log" ;;
    tune-ce) python3 -m benchmarks.tune_cross_entropy 2>&1 | tee "$out/tune-ce.log" ;;
    tune) python3 -m benchmarks.tune --hidden "${TUNE_HIDDEN:-4096}" --out "$out/tune.json" 2>&1 | tee "$out/tune.log" ;;
    bench) python3 -m benchmarks.kernels --out "$out/kernels.json" 2>&1 | tee "$out/bench.log" ;;
    bench-main) python3 -m benchmarks.kernels --no-sweeps --out "$out/kernels.json" 2>&1 | tee "$out/bench.log" ;;
    bench-losses) python3 -m benchmarks.kernels --only cross_entropy,fused_linear --out "$out/losses.json" 2>&1 | tee "$out/losses.log" ;;
    bench-losses-main) python3 -m benchmarks.kernels --no-sweeps --only cross_entropy,fused_linear --out "$out/losses-main.json" 2>&1 | tee "$out/losses-main.log" ;;
    bench-distill) python3 -m benchmarks.kernels --no-sweeps --only kl_divergence,jsd,fused_linear_jsd --out "$out/distill.json" 2>&1 | tee "$out/distill.log" ;;
    bench-align) python3 -m benchmarks.kernels --no-sweeps --only fused_linear_dpo,fused_linear_orpo --out "$out/align.json" 2>&1 | tee "$out/align.log" ;;
    bench-sweeps) python3 -m benchmarks.kernels --sweeps-only --out "$out/sweeps.json" 2>&1 | tee "$out/sweeps.log" ;;
    convergence) python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/kernels/test_convergence.py ${FAMILIES_K:+-k "$FAMILIES_K"} > "$out/convergence.log" 2>&1; tail -n 60 "$out/convergence.log" ;;
    patching) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_patching.py tests/kernels/test_causal_lm_loss.py ${FAMILIES_K:+-k "$FAMILIES_K"} > "$out/patching.log" 2>&1; tail -n 40 "$out/patching.log" ;;
    multi-gpu-tests) timeout "${TEST_LIMIT:-600}" python3 -m pytest -m gpu -q -s -p no:cacheprovider --durations=5 tests/runtime/test_multi_gpu.py > "$out/multi-gpu-tests.log" 2>&1
      grep -E "worst|resumed from|passed|failed|Error" "$out/multi-gpu-tests.log" | tail -n 120 ;;
    scaling|headline) OUT=/tmp/bench timeout "${BENCH_LIMIT:-3600}" bash "benchmarks/$step.sh"
      tar czf "$out/$step.tgz" --exclude=checkpoints --exclude=data --exclude='*.png' -C /tmp/bench "$step" ;;
    flyte-gpu) timeout "${TEST_LIMIT:-600}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/workflows/test_finetune_gpu.py > "$out/flyte-gpu.log" 2>&1
      grep -E "pyflyte run on|passed|failed|Error" "$out/flyte-gpu.log" | tail -n 30 ;;
    recompute-curve) for layers in ${RECOMPUTE_LAYERS:-0 4 8 12 16 s16 s8 4+s12}; do  # tokens/s against peak memory
        case $layers in  # N: the first N layers whole (0: none); sM: M layers selective; N+sM: both
          0) ckpt=(--no-checkpointing) ;;
          s*) ckpt=(--no-checkpointing --selective-layers "${layers#s}") ;;
          *+s*) ckpt=(--checkpoint-layers "${layers%%+*}" --selective-layers "${layers##*+s}") ;;
          *) ckpt=(--checkpoint-layers "$layers") ;;
        esac
        python3 -m benchmarks.end_to_end --family llama ${E2E_SHAPE:+--shape $E2E_SHAPE} --variants tigon "${ckpt[@]}" ${E2E_TIGON_FLAGS:-} --seqs 4096 --micro-batch "${E2E_MICRO:-8}" --steps 4 --warmup 2 --out "$out/recompute-$layers.json" 2>&1 | grep -E "tokens/s|memory|failed"
      done
      python3 -m benchmarks.end_to_end --family llama ${E2E_SHAPE:+--shape $E2E_SHAPE} --variants liger --seqs 4096 --micro-batch "${E2E_MICRO:-8}" --steps 4 --warmup 2 --out "$out/recompute-liger-on.json" 2>&1 | grep -E "tokens/s|memory|failed"
      python3 -m benchmarks.end_to_end --family llama ${E2E_SHAPE:+--shape $E2E_SHAPE} --variants liger --no-checkpointing --seqs 4096 --micro-batch "${E2E_MICRO:-8}" --steps 4 --warmup 2 --out "$out/recompute-liger-off.json" 2>&1 | grep -E "tokens/s|memory|failed"
      python3 -m benchmarks.recompute_curve collect "$out" --out "$out/recompute-points.json" ;;
    e2e-qlora) python3 -m benchmarks.end_to_end --family llama --shape llama-3-8b --qlora --variants "${E2E_VARIANTS:-eager,liger,tigon,planner}" --seqs "${E2E_SEQS:-4096}" --micro-batch "${E2E_MICRO:-4}" --steps 5 --warmup 2 --out "$out/e2e-qlora.json" 2>&1 | tee "$out/e2e-qlora.log" ;;
    planner-tests) python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/runtime/test_planner_gpu.py 2>&1 | tail -n 40 | tee "$out/planner-tests.log" ;;
    preference-memory) python3 -m benchmarks.preference_memory --out "$out/preference-memory.json" 2>&1 | tee "$out/preference-memory.log" ;;
    adapter-tests) python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/runtime/test_adapter_parallelism_gpu.py > "$out/adapter-tests.log" 2>&1
      grep -E "worst|passed|failed|Error" "$out/adapter-tests.log" | tail -n 30 ;;
    trl) python3 -m benchmarks.trl_integration --trainers "${TRL_TRAINERS:-dpo,sft}" --out "$out/trl.json" 2>&1 | tee "$out/trl.log" ;;
    compile) for family in ${COMPILE_FAMILIES:-llama qwen3}; do for mode in eager compiled; do  # training.compile off and on
        flag=(); [ "$mode" = compiled ] && flag=(--compile)
        python3 -m benchmarks.end_to_end --family "$family" --variants "${E2E_VARIANTS:-eager,tigon}" "${flag[@]}" --seqs "${E2E_SEQS:-4096}" \
          --micro-batch "${E2E_MICRO:-4}" --steps "${E2E_STEPS:-5}" --warmup 2 --out "$out/compile-$family-$mode.json" 2>&1 | tee "$out/compile-$family-$mode.log"
      done; done ;;
    fp8) for precision in bf16 fp8; do  # tigon compiled, bf16 against FP8 matmuls
        python3 -m benchmarks.end_to_end --family llama --shape "${E2E_SHAPE:-llama-3-8b}" --variants tigon --compile \
          --precision "$precision" --seqs "${E2E_SEQS:-4096}" --micro-batch "${E2E_MICRO:-4}" --steps 5 --warmup 2 \
          --out "$out/fp8-e2e-$precision.json" 2>&1 | tee "$out/fp8-e2e-$precision.log"
      done ;;
    fp8-loss) python3 -m benchmarks.fp8_loss_curve --steps "${FP8_STEPS:-600}" --hidden "${FP8_HIDDEN:-1024}" \
        --layers "${FP8_LAYERS:-4}" --seeds "${FP8_SEEDS:-1}" ${FP8_CORPUS:+--corpus "$FP8_CORPUS"} \
        ${FP8_CORPUS_MB:+--corpus-mb "$FP8_CORPUS_MB"} ${FP8_LR:+--learning-rate "$FP8_LR"} ${FP8_MICRO:+--micro-batch "$FP8_MICRO"} \
        --out "$out/fp8-loss.json" > "$out/fp8-loss.log" 2>&1; echo "fp8-loss: exit $?"
      grep -E "against bf16|loss .* ->|wrote|Error" "$out/fp8-loss.log" | tail -n 20 ;;
    e2e) python3 -m benchmarks.end_to_end --seqs 4096 --out "$out/e2e.json" 2>&1 | tee "$out/e2e.log" ;;
    e2e-8k) python3 -m benchmarks.end_to_end --seqs 8192 --out "$out/e2e-8k.json" 2>&1 | tee "$out/e2e-8k.log" ;;
    e2e-profile) v=${E2E_VARIANTS:-eager,liger,tigon,planner}; python3 -m benchmarks.end_to_end --seqs "${E2E_SEQS:-4096}" --variants "$v" --profile --out "$out/e2e-profile.json" 2>&1 | tee "$out/e2e-profile.log" ;;
    e2e-families) f=${E2E_FAMILIES:-all}; v=${E2E_VARIANTS:-eager,liger,tigon}; python3 -m benchmarks.end_to_end --family "$f" --variants "$v" --seqs 4096 --micro-batch 4 --warmup 1 --steps 2 --time-budget "${E2E_BUDGET:-520}" --out "$out/e2e-families-${f//,/-}.json" 2>&1 | tee "$out/e2e-families-${f//,/-}.log" ;;
    e2e-longest) v=${E2E_VARIANTS:-eager,liger,tigon,planner}; python3 -m benchmarks.end_to_end --seqs 8192 --micro-batch "${E2E_MICRO:-8}" --variants "$v" --longest --steps 1 --warmup 1 --out "$out/e2e-longest-${v//,/-}.json" 2>&1 | tee "$out/e2e-longest-${v//,/-}.log" ;;
    e2e-longest-families) f=${E2E_FAMILIES:-all}; v=${E2E_VARIANTS:-eager,liger,tigon}; python3 -m benchmarks.end_to_end --family "$f" --variants "$v" --seqs 4096 --micro-batch 1 --longest-only --steps 1 --warmup 1 --time-budget "${E2E_BUDGET:-520}" --out "$out/e2e-longest-${f//,/-}.json" 2>&1 | tee "$out/e2e-longest-${f//,/-}.log" ;;
    varlen) python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_cudnn_attention_gpu.py > "$out/varlen-tests.log" 2>&1; tail -n 30 "$out/varlen-tests.log"
      python3 -m benchmarks.varlen_attention --out "$out/varlen-attention.json" 2>&1 | tee "$out/varlen-attention.log" ;;
    packed) python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_attention_gpu.py > "$out/packed-tests.log" 2>&1; tail -n 30 "$out/packed-tests.log"
      python3 -m benchmarks.packed_attention --time-budget "${PACKED_BUDGET:-360}" --out "$out/packed.json" 2>&1 | tee "$out/packed.log" ;;
    fp16-smoke) for run in ${FP16_RUNS:-torch:ddp torch:fsdp lightning:ddp lightning:fsdp hf:ddp}; do
        python3 -m tigon.runtime train examples/demo.yaml --set training.max_steps=150 --set training.precision=fp16 \
          --set trainer="${run%%:*}" --set parallelism.strategy="${run##*:}" --set eval.every_steps=0 \
          --set checkpoint.export=false --set logging.tensorboard=false --set logging.run_dir="$out/fp16-${run/:/-}" \
          > "$out/fp16-${run/:/-}.log" 2>&1; echo "fp16 $run: exit $?"; grep -h "loss" "$out/fp16-${run/:/-}.log" | tail -n 3
      done ;;
    checkpoint-scale) timeout "${CKPT_LIMIT:-480}" python3 -m benchmarks.checkpoint_scale --shape "${CKPT_SHAPE:-llama-3-8b}" \
        --seq "${CKPT_SEQ:-1024}" ${CKPT_RUN_DIR:+--run-dir "$CKPT_RUN_DIR"} --out "$out/checkpoint-scale-${CKPT_SHAPE:-llama-3-8b}.json" \
        2>&1 | tee "$out/checkpoint-scale-${CKPT_SHAPE:-llama-3-8b}.log" ;;
    distill-smoke) python3 -m tigon.runtime train examples/demo.yaml --set training.max_steps="${TEACHER_STEPS:-150}" \
        --set eval.every_steps=0 --set checkpoint.every_steps=0 --set logging.tensorboard=false \
        --set logging.run_dir="$out/distill-teacher" > "$out/distill-teacher.log" 2>&1; echo "teacher: exit $?"
      launch=(python3); nproc=${DISTILL_NPROC:-1}
      [ "$nproc" -gt 1 ] && launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$nproc")
      for run in ${DISTILL_RUNS:-distill:ddp distill:fsdp dpo:fsdp kto:fsdp}; do
        teacher=(); [ "${run%%:*}" = distill ] && teacher=(--set objective.teacher.path="$out/distill-teacher/export")
        strategy=(--set parallelism.strategy="${run##*:}")
        [ "${run##*:}" = zero3 ] && strategy=(--set parallelism.strategy=deepspeed --set parallelism.zero_stage=3)
        "${launch[@]}" -m tigon.runtime train "examples/${run%%:*}.yaml" "${teacher[@]}" --set training.precision=bf16 \
          --set training.max_steps="${DISTILL_STEPS:-50}" "${strategy[@]}" --set eval.every_steps=0 \
          --set checkpoint.every_steps=0 --set checkpoint.export=false --set logging.tensorboard=false \
          --set logging.progress_bar=false --set logging.run_dir="$out/${run/:/-}" > "$out/${run/:/-}.log" 2>&1
        echo "bf16 $run: exit $?"
        grep -hE "train loss|ce_loss|distill_loss|rewards/margins|eval loss" "$out/${run/:/-}.log" | tail -n 5
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
