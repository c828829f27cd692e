#!/usr/bin/env bash
# One device session: the latency sweep (both variants) into $OUT, then the GPU-marked tests.
# Run from the repository root with .whl/ carried:  bash scripts/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-reports}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv > "$OUT/gpu_nvidia_smi.csv" 2>&1
t0=$(date +%s)
MAX_TOTAL_S="${MAX_TOTAL_S:-200}" bash scripts/gpu_bench.sh > "$OUT/gpu_bench.log" 2>&1
echo "sweep: exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_bench.log"
tail -5 "$OUT/gpu_bench.log"
t1=$(date +%s)
PYTHONPATH="/tmp/site:$PWD" timeout "${TEST_TIMEOUT_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_runtimes.py tests/test_runtimes_numerics.py tests/test_kernels_w4a16.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $? after $(( $(date +%s) - t1 )) s" | tee -a "$OUT/gpu_tests.log"
tail -25 "$OUT/gpu_tests.log"
