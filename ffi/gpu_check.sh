#!/usr/bin/env bash
# One GPU session for the native kernels: load (or build) the CUDA library, run the native
# tests against the spec on the GPU, then time the kernels. Logs and JSON go to $OUT.
#
#   OUT=/tmp/o JAXATTN_NATIVE_LIB_DIR=build/gpu/ffi ffi/gpu_check.sh [bench_native.py args]
#
# A prebuilt library in $JAXATTN_NATIVE_LIB_DIR is used when it loads; otherwise the CUDA
# library is built here for sm_90 first.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/jaxattn-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

lib="${JAXATTN_NATIVE_LIB_DIR:-}/libjaxattn_cuda.so"
if [ -n "${JAXATTN_NATIVE_LIB_DIR:-}" ] && python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$lib"; then
  export JAXATTN_NATIVE_LIB_DIR="$(cd "$JAXATTN_NATIVE_LIB_DIR" && pwd)"
  stamp "using the prebuilt $lib"
else
  stamp "building the CUDA library (sm_90)"
  if ! { cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAXATTN_HIP=OFF \
           -DJAXATTN_CUDA_ARCHS=90 && cmake --build build/gpu -j "$(nproc)"; } > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    exit 1
  fi
  export JAXATTN_NATIVE_LIB_DIR="$PWD/build/gpu/ffi"
  stamp "built"
fi

stamp "tests"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_native.py \
  > "$out/tests.log" 2>&1
echo "pytest exit: $?"
grep -E "passed|failed|error" "$out/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -30

stamp "timings"
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_native.py --json "$out/native.json" "$@" \
  > "$out/bench.log" 2>&1
echo "bench exit: $?"
grep -v "^|" "$out/bench.log" | grep -E "ERROR|error" | head -10
sed -n '/^| op/,$p' "$out/bench.log"
stamp "done"
