#!/usr/bin/env bash
# Download into .whl/ the wheels ffnquant needs on the GPU device image but that the image lacks.
#
#   scripts/fetch_gpu_wheels.sh          # run here (PyPI reachable) before a device call
#
# The device has no package registry; scripts/gpu_bench.sh installs every wheel in .whl/ with
# `pip install --no-index --no-deps --target /tmp/site`. The image is Python 3.12, CUDA 13,
# manylinux x86_64, so the wheels are fetched for that platform with --no-deps (their
# dependencies, numpy/torch/packaging, are already on the image; see
# scripts/device_image_packages.txt). Versions are pinned to what is installed here, so the
# device runs the code that was tested here. Idempotent: wheels already in .whl/ are kept.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST=.whl
MAX_MIB=60   # a device call carries at most 64 MiB of working tree; leave room for the rest

# distribution name -> version installed here (the pins)
local_version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true; }
declare -A PINS=(
    [bitsandbytes]="$(local_version bitsandbytes)"
    [tomli_w]="$(local_version tomli-w)"
)
for dist in "${!PINS[@]}"; do
    [[ -n "${PINS[$dist]}" ]] || { echo "fetch_gpu_wheels: $dist is not installed here, so there is no version to pin" >&2; exit 1; }
done

# manylinux_2_24 is needed: bitsandbytes 0.50.2 publishes only a manylinux_2_24 x86_64 wheel
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done

mkdir -p "$DEST"
shopt -s nullglob

size_of() { stat -c %s "$1" | awk '{ if ($1 < 1048576) printf "%.1f KiB", $1 / 1024; else printf "%.1f MiB", $1 / 1048576 }'; }

for dist in "${!PINS[@]}"; do
    version="${PINS[$dist]}"
    # wheel file names normalise the distribution to lower case with '_' (PEP 427)
    stem="${dist//-/_}"
    # one version per package: drop wheels of other versions fetched earlier
    for old in "$DEST/${stem}"-*.whl; do
        [[ "$old" == "$DEST/${stem}-${version}-"* ]] || { echo "removing older $old"; rm -f -- "$old"; }
    done
    have=("$DEST/${stem}-${version}-"*.whl)
    if (( ${#have[@]} )); then
        echo "have     ${have[0]##*/}"
        continue
    fi
    echo "fetching ${dist}==${version}"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${platform_args[@]}" \
        -d "$DEST" "${dist}==${version}"
done

# bitsandbytes must carry a CUDA 13 kernel library, else the bnb-cuda runtime is unusable there
bnb=("$DEST/bitsandbytes-${PINS[bitsandbytes]}-"*.whl)
(( ${#bnb[@]} == 1 )) || { echo "fetch_gpu_wheels: expected one bitsandbytes wheel in $DEST, found ${#bnb[@]}" >&2; exit 1; }
sos=$(unzip -Z1 "${bnb[0]}" | grep -E '\.so$' | sed 's|.*/||' | sort || true)
echo "native libraries in ${bnb[0]##*/}:"
echo "${sos:-  (none)}" | sed 's/^/  /'
cuda13=$(echo "$sos" | grep -E '^libbitsandbytes_cuda13[0-9]*\.so$' || true)
if [[ -z "$cuda13" ]]; then
    echo "fetch_gpu_wheels: ${bnb[0]##*/} has no libbitsandbytes_cuda13*.so; the CUDA 13 device cannot load it" >&2
    exit 1
fi
echo "CUDA 13 binary: $(echo "$cuda13" | paste -sd' ')"

echo "wheels in $DEST:"
for w in "$DEST"/*.whl; do printf '  %-70s %s\n' "${w##*/}" "$(size_of "$w")"; done
total_b=$(stat -c %s "$DEST"/*.whl | awk '{t += $1} END {print t}')
total_mib=$(awk -v b="$total_b" 'BEGIN {printf "%.1f", b / 1048576}')
if (( total_b >= MAX_MIB * 1048576 )); then
    echo "fetch_gpu_wheels: $DEST holds ${total_mib} MiB, over the ${MAX_MIB} MiB limit of a device call" >&2
    exit 1
fi
echo "total ${total_mib} MiB (under ${MAX_MIB} MiB)"
