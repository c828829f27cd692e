#!/usr/bin/env bash
# One device session, prepared and tested on a CPU (tests/test_device_ready.py runs its --dry-run under the
# device image's packages). Within 8 minutes, so a rerun fits in the 15 minutes a task is lent:
#   0. the plan's engine on CUDA: a tiny random Llama planned with --device cuda, every candidate scored there
#      -> $OUT/engine-cuda/
#   1. the W4A16 kernels against fp16 cuBLAS at decode and prefill shapes   -> $OUT/w4a16-kernels/
#   2. the fused int8/fp8 activation quantization against bf16, eager and graph-replayed -> $OUT/actquant-kernels/
#   3. the plan's latency table on the GPU runtimes (plan --runtime triton-cuda,torch-cuda-graph) -> $OUT/gpu-plan-latency/
#   4. the FFN latency sweep of every runtime (scripts/gpu_bench.sh)          -> $OUT/latency_gpu.{json,md}
#   5. the GPU-marked tests (every kernel against its reference on CUDA)     -> $OUT/gpu_tests.log
#   6. only with PLAN_8B_LIMIT_S set: the default plan of a random-weight bf16 model at Llama-3-8B's shapes, planned
#      to ppl+1% on the GPU (benchmarks/plan_cost.py --random-model llama3-8b), stopped at that limit, its Python
#      stacks sampled every STACKS_EVERY_S (20) seconds into plan.stacks -> $OUT/plan-8b/
# STAGES=a,b,... runs only the stages named (engine_cuda, w4a16_kernels, actquant_kernels, gpu_plan_latency,
# gpu_bench, gpu_tests, plan_8b).
# Each stage has its own time limit and a failed stage does not stop the next; every stage's exit code is in
# $OUT/session.log. Run from the repository root with .whl/ carried:
#   bash scripts/gpu_session.sh            # on the device
#   bash scripts/gpu_session.sh --dry-run  # the same code paths on a CPU (Triton's interpreter, torch-cpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-reports}"
PY="${PYTHON:-python3}"
DRY=""
[[ "${1:-}" == "--dry-run" ]] && DRY="--dry-run"
mkdir -p "$OUT"
export PYTHONPATH="${SITE:-/tmp/site}:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # SITE: where .whl/ was installed
LOG="$OUT/session.log"
: > "$LOG"
t_start=$(date +%s)

stage() {  # stage NAME LIMIT_S COMMAND...: run it with a time limit, log its exit code and time
    local name="$1" limit="$2"; shift 2
    if [[ -n "${STAGES:-}" && ",$STAGES," != *",$name,"* ]]; then return 0; fi
    local t0; t0=$(date +%s)
    echo "[$(( t0 - t_start )) s] $name (limit ${limit} s) ..." | tee -a "$LOG"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "[$(( $(date +%s) - t_start )) s] $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
    tail -3 "$OUT/$name.log"
}

if [[ -z "$DRY" ]]; then
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv \
        > "$OUT/gpu_nvidia_smi.csv" 2>&1
else
    export TRITON_INTERPRET=1  # the Triton kernels on CPU tensors
fi
# the engine that plans on the GPU (--device cuda), end to end on a tiny model first: a fault shows in seconds.
# --objective bytes: every candidate is scored (on the device) and the rounds verify quantized layers (a latency
# table would keep float at this size)
if [[ -z "$DRY" ]]; then ENGINE_ARGS="--device cuda --objective bytes"; else ENGINE_ARGS="--device cpu --objective bytes --calib-tokens 512 --eval-tokens 512 --seq-len 128"; fi  # the dry run: fewer tokens, the same path
stage engine_cuda "${ENGINE_LIMIT_S:-100}" "$PY" benchmarks/plan_cost.py --random-model tiny --skip-peer --skip-apply \
    --skip-export --progress --step-limit-s 90 --plan-args "$ENGINE_ARGS" --out "$OUT/engine-cuda"
stage w4a16_kernels "${W4_LIMIT_S:-100}" "$PY" benchmarks/w4a16_kernels.py $DRY --max-s 70 --out "$OUT/w4a16-kernels"
stage actquant_kernels "${ACT_LIMIT_S:-100}" "$PY" benchmarks/actquant_kernels.py $DRY --out "$OUT/actquant-kernels"
stage gpu_plan_latency "${PLAN_LIMIT_S:-80}" "$PY" benchmarks/gpu_plan_latency.py $DRY --out "$OUT/gpu-plan-latency"
if [[ "${SKIP_SWEEP:-0}" != "1" ]]; then  # the sweep's own dry run is tested on its own
    stage gpu_bench "${SWEEP_LIMIT_S:-130}" env MAX_TOTAL_S="${MAX_TOTAL_S:-100}" OUT="$OUT" bash scripts/gpu_bench.sh $DRY
fi
if [[ -z "$DRY" ]]; then
    stage gpu_tests "${TEST_LIMIT_S:-70}" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_w4a16.py \
        tests/test_kernels_w4a16_tiled.py tests/test_kernels_actquant.py tests/test_runtimes.py tests/test_runtimes_numerics.py
fi
if [[ -n "${PLAN_8B_LIMIT_S:-}" ]]; then  # the model is written at run time (16 GB of bf16 shards under /tmp)
    if [[ -z "$DRY" ]]; then MODEL8=llama3-8b; ARGS8="--device cuda --runtime triton-cuda,torch-cuda-graph";
    else MODEL8=tiny; ARGS8="--device cpu --runtime torch-cpu"; fi
    stage plan_8b "$(( PLAN_8B_LIMIT_S + 240 ))" "$PY" benchmarks/plan_cost.py --random-model "$MODEL8" --skip-peer \
        --skip-apply --skip-export --progress --step-limit-s "$PLAN_8B_LIMIT_S" --stacks-every "${STACKS_EVERY_S:-20}" \
        --plan-args "$ARGS8" --out "$OUT/plan-8b"
    # a plan killed outright (the kernel's OOM killer) leaves its staging folder: more files than a device call
    # brings back, which would keep the logs from coming back too
    rm -rf "$OUT"/plan-8b/plan/.ffnquant-staging-* "$OUT"/plan-8b/.ffnquant-staging-*
fi
echo "session: $(( $(date +%s) - t_start )) s in all" | tee -a "$LOG"
