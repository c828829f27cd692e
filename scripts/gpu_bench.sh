#!/usr/bin/env bash
# Latency of the FFN variants on an NVIDIA GPU (made for an H200), from the working tree.
#
#   scripts/gpu_bench.sh                 # d_model 4096, writes $OUT/latency_gpu.{json,md} (else reports/)
#   scripts/gpu_bench.sh --dry-run       # the same code paths at d_model 128 on whatever is here (CPU is fine)
#   D_MODEL=2048 VARIANTS=swiglu scripts/gpu_bench.sh
#
# Installs nothing from a registry. Each wheel under .whl/ (scripts/fetch_gpu_wheels.sh puts them
# there) whose package is not importable is unpacked (no index, no dependencies) into /tmp/site,
# which is put on PYTHONPATH.
# Runtimes that are not really there (no onnxruntime-gpu, no bitsandbytes, no TensorRT) are
# recorded as "unavailable: <reason>" in the report instead of failing the run. The sweep
# stops starting new models after MAX_TOTAL_S seconds (default 270) so it ends within 6 minutes.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
PY="${PYTHON:-python3}"  # the GPU image's torch lives under python3

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1

shopt -s nullglob
wheels=()
for w in .whl/*.whl; do
    # the wheel's distribution name is its import name for the wheels we carry (bitsandbytes, tomli_w)
    mod="${w##*/}"; mod="${mod%%-*}"
    "$PY" -c "import $mod" >/dev/null 2>&1 || wheels+=("$w")
done
if (( ${#wheels[@]} )); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH" \
        || echo "gpu_bench: could not unpack ${wheels[*]}; what needs them will be reported unavailable or fail" >&2
fi
shopt -u nullglob

OUT_DIR="${OUT:-reports}"
mkdir -p "$OUT_DIR"
# torch-cuda: eager; -graph: the same kernels replayed from a CUDA graph (decode sizes are launch-bound);
# -compile: torch.compile then a graph; triton-cuda: ffnquant's own W4A16 kernel (graph replay).
# Order matters under MAX_TOTAL_S: the graph-replayed kernels and ours first, compile (slow to build) last.
RUNTIMES="${RUNTIMES:-torch-cuda-graph,triton-cuda,torch-cuda,bnb-cuda,torch-cuda-compile,ort-cuda,ort-trt}"
SCHEMES="${SCHEMES:-fp16,bf16,w8a8-dynamic-s8,w8a16,w8a8-s8,w4a16-g128,w4a16-g128-asym,fp8-e4m3,fp8-e4m3-dynamic,nf4,fp4,llm-int8,llm-int8-t0}"
# SwiGLU first: the sweep stops starting new models at MAX_TOTAL_S, and SwiGLU at d_model 4096
# (d_ff 11008, Llama-2-7B's FFN) is the shape the targets are about.
VARIANTS="${VARIANTS:-swiglu,relu}"
if (( DRY_RUN )); then
    D_MODEL="${D_MODEL:-128}"; TOKENS="${TOKENS:-1,16}"; BUDGET_S="${BUDGET_S:-0.02}"; NAME="${NAME:-latency_gpu_dryrun}"
    RUNTIMES="${RUNTIMES},torch-cpu,bnb-cpu,triton-cpu"   # so the sweep measures something on a machine without a GPU
    export TRITON_INTERPRET=1   # triton-cpu: ffnquant's Triton kernels in Triton's interpreter
else
    D_MODEL="${D_MODEL:-4096}"; TOKENS="${TOKENS:-1,16,512,2048}"; BUDGET_S="${BUDGET_S:-0.25}"; NAME="${NAME:-latency_gpu}"
fi

"$PY" - <<'PYEOF' || true
# What is here, before measuring (never fails the script).
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
from ffnquant.runtimes import available_runtimes
for name, a in available_runtimes().items():
    print(f"  {name:10s} {'available' if a.available else 'unavailable'}: {a.reason}")
PYEOF

"$PY" -m ffnquant bench \
    --variants "$VARIANTS" --d-model "$D_MODEL" \
    --runtimes "$RUNTIMES" --skip-unavailable \
    --schemes "$SCHEMES" --tokens "$TOKENS" \
    --budget-s "$BUDGET_S" --warmup 3 --min-repeats 5 \
    --max-total-s "${MAX_TOTAL_S:-270}" \
    --out "$OUT_DIR" --name "$NAME" --no-progress

cat "$OUT_DIR/$NAME.md"
