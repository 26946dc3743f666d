#!/usr/bin/env bash
# Run on a GPU machine from the repository root: GPU tests, the demo, then benchmarks.
# Results land under $OUT. Usage: bash benchmarks/gpu_run.sh [tests] [attention] [demo] [tune] [bench] [bench-main] [bench-distill] [bench-sweeps] [host-overhead] [flce-traffic]
#   [planner-tests] [multi-gpu-tests (4 GPUs: the three trainers
#   under DDP, FSDP2 and ZeRO-2/3 on 1, 2 and 4 GPUs, a killed rank; TEST_LIMIT seconds)] [scaling (benchmarks/scaling.sh)]
#   [headline (benchmarks/headline.sh)] (BENCH_LIMIT seconds each; results in $OUT/scaling.tgz, headline.tgz) [e2e] [e2e-8k] [e2e-longest] [e2e-families] [e2e-longest-families]   (end-to-end: benchmarks/end_to_end.py, one step per
#   device call; E2E_VARIANTS=eager,liger picks the variants of e2e-longest or e2e-families, to keep each call under the
#   device's 10 minutes; e2e-families runs every model family at seq 4096 within a 520 s budget and names the families
#   it did not reach: E2E_FAMILIES=gemma2,phi3 runs those in the next call; E2E_BUDGET sets its budget in seconds; E2E_MICRO the micro-batch of e2e-longest, default 8;
#   e2e-longest-families searches each family's longest sequence at micro-batch 1, up to its context length, with the same
#   E2E_FAMILIES, E2E_VARIANTS and E2E_BUDGET); e2e-profile adds one profiled step per variant (time per kernel kind;
#   E2E_SEQS, E2E_VARIANTS); fp16-smoke trains the demo in fp16 with the torch, Lightning and HF
#   trainers under DDP and FSDP2 (one process) and prints the end of each run's log)
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
      grep -E "worst relative|resumed from|passed|failed|Error" "$out/multi-gpu-tests.log" | tail -n 60 ;;
    scaling|headline) OUT=/tmp/bench timeout "${BENCH_LIMIT:-3600}" bash "benchmarks/$step.sh"
      tar czf "$out/$step.tgz" --exclude=checkpoints --exclude=data --exclude='*.png' -C /tmp/bench "$step" ;;
    planner-tests) python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/runtime/test_planner_gpu.py 2>&1 | tail -n 40 | tee "$out/planner-tests.log" ;;
    e2e) python3 -m benchmarks.end_to_end --seqs 4096 --out "$out/e2e.json" 2>&1 | tee "$out/e2e.log" ;;
    e2e-8k) python3 -m benchmarks.end_to_end --seqs 8192 --out "$out/e2e-8k.json" 2>&1 | tee "$out/e2e-8k.log" ;;
    e2e-profile) v=${E2E_VARIANTS:-eager,liger,tigon,planner}; python3 -m benchmarks.end_to_end --seqs "${E2E_SEQS:-4096}" --variants "$v" --profile --out "$out/e2e-profile.json" 2>&1 | tee "$out/e2e-profile.log" ;;
    e2e-families) f=${E2E_FAMILIES:-all}; v=${E2E_VARIANTS:-eager,liger,tigon}; python3 -m benchmarks.end_to_end --family "$f" --variants "$v" --seqs 4096 --micro-batch 4 --warmup 1 --steps 2 --time-budget "${E2E_BUDGET:-520}" --out "$out/e2e-families-${f//,/-}.json" 2>&1 | tee "$out/e2e-families-${f//,/-}.log" ;;
    e2e-longest) v=${E2E_VARIANTS:-eager,liger,tigon,planner}; python3 -m benchmarks.end_to_end --seqs 8192 --micro-batch "${E2E_MICRO:-8}" --variants "$v" --longest --steps 1 --warmup 1 --out "$out/e2e-longest-${v//,/-}.json" 2>&1 | tee "$out/e2e-longest-${v//,/-}.log" ;;
    e2e-longest-families) f=${E2E_FAMILIES:-all}; v=${E2E_VARIANTS:-eager,liger,tigon}; python3 -m benchmarks.end_to_end --family "$f" --variants "$v" --seqs 4096 --micro-batch 1 --longest-only --steps 1 --warmup 1 --time-budget "${E2E_BUDGET:-520}" --out "$out/e2e-longest-${f//,/-}.json" 2>&1 | tee "$out/e2e-longest-${f//,/-}.log" ;;
    fp16-smoke) for run in ${FP16_RUNS:-torch:ddp torch:fsdp lightning:ddp lightning:fsdp hf:ddp}; do
        python3 -m tigon.runtime train examples/demo.yaml --set training.max_steps=150 --set training.precision=fp16 \
          --set trainer="${run%%:*}" --set parallelism.strategy="${run##*:}" --set eval.every_steps=0 \
          --set checkpoint.export=false --set logging.tensorboard=false --set logging.run_dir="$out/fp16-${run/:/-}" \
          > "$out/fp16-${run/:/-}.log" 2>&1; echo "fp16 $run: exit $?"; grep -h "loss" "$out/fp16-${run/:/-}.log" | tail -n 3
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
