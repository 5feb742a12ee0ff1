#!/usr/bin/env bash
# One GPU job for the native kernels: the stand-alone self-tests (ffi/tests_gpu), load
# (or build) the CUDA library, time the kernels, run the native tests against the spec on the
# GPU, and summarise the SASS of the main kernels. Logs and JSON go to $OUT.
#
#   OUT=/tmp/o JAXATTN_NATIVE_LIB_DIR=build/gpu/ffi ffi/gpu_check.sh
#
# A prebuilt library in $JAXATTN_NATIVE_LIB_DIR is used when it loads; otherwise the CUDA
# library is built here for sm_90 first (not at all when timings and tests are all skipped).
# Knobs (environment):
#   SELFTESTS      which of ffi/tests_gpu/{decode,prefill,cascade}_selftest.cu to build and run
#                  (default "decode prefill cascade"; "skip": none)
#   SELFTEST_FLAGS extra nvcc arguments for every self-test build, e.g. a build switch under
#                  trial: "-DJAXATTN_DECODE_MMA_STAGES=4"
#   SELFTEST_BIN   a directory of self-tests built elsewhere from this tree (same names, e.g.
#                  decode_selftest): those are run instead of built here
#   SANITIZE       run the self-tests' robustness cases (--robust: every kernel, bad indices,
#                  NaN, and a valid case each) under compute-sanitizer: "1" for --tool memcheck,
#                  or a list of tools ("memcheck racecheck synccheck initcheck"); each log
#                  ($OUT/<self-test>.<tool>.log) ends in an ERROR SUMMARY, and the step prints
#                  exit 99 on any error. $COMPUTE_SANITIZER names the binary (default:
#                  compute-sanitizer on PATH, else CUDA's bin); SANITIZE_TIMEOUT, seconds.
#                  Only the sanitizer runs, e.g.:
#                    SANITIZE=1 DECODE_ARGS=skip PREFILL_ARGS=skip TESTS=skip ffi/gpu_check.sh
#   TESTS          "skip": do not run tests/test_native.py
#   SUITES         "run": also run the suites that exercise the GPU, file by file (SUITE_FILES,
#                  default below), each under pytest-xdist (SUITE_WORKERS, default 8) with -v and
#                  a time limit of its own (SUITE_TIMEOUT, default 300 s): a failing test is named
#                  from the live -v lines even when its file runs out of time, which a -q run's
#                  summary at the end is not; a file out of time also lists the tests its
#                  workers had started and not finished
#   NCU_CASCADE    "1": read the cascade kernel's bounds with ncu (throughput, memory, occupancy,
#                  scheduler and warp-state sections) on the self-test's issue batch and on each of
#                  its levels alone (cascade_selftest --profile 2 issue|own|prefix: the wgmma
#                  prefix level; one launch after two warm-ups), $out/ncu_cascade_<batch>.txt;
#                  $NCU names the binary (default: ncu on PATH, else CUDA's bin). Add -lineinfo to
#                  SELFTEST_FLAGS for source lines in an ncu report. Only the readings, e.g.:
#                    NCU_CASCADE=1 SELFTESTS=skip SELFTEST_FLAGS=-lineinfo DECODE_ARGS=skip \
#                      PREFILL_ARGS=skip TESTS=skip ffi/gpu_check.sh
#   CASCADE_PROXY  "1": build and run ffi/tests_gpu/cascade_split_proxy.cu (the prefix level as the
#                  Hopper prefill beside the own level as paged decode, on two streams: a timing
#                  proxy for a two-kernel cascade), $out/cascade_split_proxy.log; with SELFTEST_BIN
#                  holding a cascade_split_proxy built elsewhere from this tree, that one runs
#   SASS           "skip": no summary of the library's machine code at the end
#   PREFILL_KERNELS  prefill kernels to time (JAXATTN_PREFILL_KERNEL values; default "auto mma")
#   DECODE_ARGS    extra bench_native.py arguments for the decode timings ("skip": none)
#   PREFILL_ARGS   extra bench_native.py arguments for the prefill timings ("skip": none)
#   DECODE_K, PREFILL_K, CASCADE_K   pytest -k expressions for the decode / prefill / cascade tests
#                  (the cascade ones run from the shared suite: test_kernels, test_robustness)
#   TEST_TIMEOUT, BENCH_TIMEOUT   seconds per step
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

need_lib=1
[ "${DECODE_ARGS:-}" = skip ] && [ "${PREFILL_ARGS:-}" = skip ] && [ "${TESTS:-}" = skip ] &&
  [ "${SUITES:-}" != run ] && need_lib=0
lib="${JAXATTN_NATIVE_LIB_DIR:-}/libjaxattn_cuda.so"
if [ "$need_lib" = 0 ]; then
  stamp "no timings or tests: the CUDA library is not needed"
elif [ -n "${JAXATTN_NATIVE_LIB_DIR:-}" ] && python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$lib"; then
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
lib="${JAXATTN_NATIVE_LIB_DIR:-}/libjaxattn_cuda.so"

build_selftest() {  # name, nvcc arguments...: $out/name, built here or from SELFTEST_BIN
  local name="$1"
  shift
  if [ -n "${SELFTEST_BIN:-}" ] && [ -x "$SELFTEST_BIN/$name" ]; then
    cp "$SELFTEST_BIN/$name" "$out/$name"  # built elsewhere from this tree
  elif ! nvcc -std=c++17 -O3 -Iffi/include -Iffi/src ${SELFTEST_FLAGS:-} "$@" -o "$out/$name" \
      > "$out/$name.build.log" 2>&1; then
    tail -20 "$out/$name.build.log"
    return 1
  fi
}

selftest() {  # name, nvcc arguments...: build, then run with no arguments
  local name="$1"
  stamp "self-test: $name"
  build_selftest "$@" || return
  timeout "${BENCH_TIMEOUT:-240}" "$out/$name" > "$out/$name.log" 2>&1
  echo "exit $?"
  grep -c PASS "$out/$name.log"
  grep -v PASS "$out/$name.log" | tail -40
}

sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
sanitize() {  # name (a self-test built by selftest)
  local name="$1" tool tools="${SANITIZE:-}"
  [ "$tools" = 1 ] && tools=memcheck
  [ -x "$out/$name" ] || { echo "no $out/$name to run under compute-sanitizer"; return; }
  for tool in $tools; do
    stamp "compute-sanitizer --tool $tool: $name --robust"
    timeout "${SANITIZE_TIMEOUT:-600}" "$sanitizer" --tool "$tool" --error-exitcode 99 \
      "$out/$name" --robust > "$out/$name.$tool.log" 2>&1
    echo "exit $? (99: the sanitizer found errors)"
    grep -E "ERROR SUMMARY|robustness:" "$out/$name.$tool.log"
    grep -E "^=========" "$out/$name.$tool.log" | grep -v "ERROR SUMMARY" | head -20
  done
}

ncu_cascade() {  # the cascade kernel under ncu: the issue batch and each level alone
  local which ncu_bin="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"
  [ -x "$out/cascade_selftest" ] || { echo "no $out/cascade_selftest to profile"; return; }
  for which in issue own prefix; do
    stamp "ncu: cascade_selftest --profile 2 $which"
    timeout "${BENCH_TIMEOUT:-240}" "$ncu_bin" --kernel-name regex:cascade_mma_kernel \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats "$out/cascade_selftest" --profile 2 "$which" \
      > "$out/ncu_cascade_$which.txt" 2>&1
    echo "exit $?"
    grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Issued Warp|No Eligible|Achieved Occupancy" \
      "$out/ncu_cascade_$which.txt" | head -20
  done
}

bench() {  # name, env assignment, bench_native.py args...
  local name="$1" envset="$2"
  shift 2
  stamp "timings: $name"
  env $envset timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_native.py \
    --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "exit $?"
  grep -E "ERROR|Traceback" "$out/$name.log" | head -5
  sed -n '/^| op/,$p' "$out/$name.log"
}

tests() {  # name, env assignment, pytest -k expression[, test files (default test_native.py)]
  local name="$1" envset="$2" expr="$3" files="${4:-tests/test_native.py}"
  stamp "tests: $name"
  env $envset timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rfE -p no:cacheprovider \
    $files ${expr:+-k "$expr"} > "$out/$name.log" 2>&1
  echo "pytest exit: $?"
  grep -E "passed|failed|error" "$out/$name.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -20
}

suites() {  # the GPU-relevant suites, file by file
  local f name rc
  for f in ${SUITE_FILES:-tests/test_native.py tests/test_ops.py tests/test_kernels.py \
      tests/test_robustness.py tests/test_pallas_mgpu.py tests/test_pallas_mgpu_prefill.py \
      tests/test_pallas_mgpu_cascade.py tests/test_engine.py tests/test_engine_cascade.py \
      tests/test_engine_fp8.py}; do
    name="suite_$(basename "$f" .py)"
    stamp "suite: $f"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SUITE_TIMEOUT:-300}" python3 -m pytest \
      -n "${SUITE_WORKERS:-8}" -v -rfE -p no:cacheprovider "$f" > "$out/$name.log" 2>&1
    rc=$?
    echo "pytest exit: $rc (124: out of time)"
    echo "$(grep -c " PASSED " "$out/$name.log") passed, $(grep -c " SKIPPED " "$out/$name.log") skipped"
    grep -oE "(FAILED|ERROR) [^ ]+::[^ ]+" "$out/$name.log" | sort -u | head -20
    if [ "$rc" = 124 ]; then  # the tests a worker had started and not finished
      echo "unfinished:"
      comm -23 <(grep -oE "^tests/[^ ]+::[^ ]+" "$out/$name.log" | sort -u) \
        <(grep -oE "(PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS) tests/[^ ]+::[^ ]+" "$out/$name.log" |
          awk '{print $2}' | sort -u) | head -20
    fi
  done
}

sm90a=(-gencode=arch=compute_90a,code=sm_90a -DJAXATTN_HAVE_SM90A)
prefill_srcs=(ffi/src/prefill.cu ffi/src/prefill_fp8.cu ffi/src/prefill_sm90.cu
  ffi/src/prefill_sm90_persistent.cu)
cascade_args=("${sm90a[@]}" ffi/tests_gpu/cascade_selftest.cu)
selftests=" ${SELFTESTS:-decode prefill cascade} "
if [ "$selftests" != " skip " ]; then
  case "$selftests" in *" decode "*)
    selftest decode_selftest -arch=sm_90 ffi/tests_gpu/decode_selftest.cu ;;
  esac
  case "$selftests" in *" prefill "*)
    selftest prefill_selftest "${sm90a[@]}" ffi/tests_gpu/prefill_selftest.cu "${prefill_srcs[@]}" ;;
  esac
  # sm_90a: the wgmma prefix level (the default on Hopper) is built and checked too, where an
  # sm_90 build reports it SKIP.
  case "$selftests" in *" cascade "*) selftest cascade_selftest "${cascade_args[@]}" ;; esac
  if [ -n "${SANITIZE:-}" ]; then
    for name in decode prefill cascade; do
      case "$selftests" in *" $name "*) sanitize "${name}_selftest" ;; esac
    done
  fi
fi
if [ "${NCU_CASCADE:-}" = 1 ]; then
  [ -x "$out/cascade_selftest" ] || build_selftest cascade_selftest "${cascade_args[@]}"
  ncu_cascade
fi
if [ "${CASCADE_PROXY:-}" = 1 ]; then
  selftest cascade_split_proxy "${sm90a[@]}" ffi/tests_gpu/cascade_split_proxy.cu \
    "${prefill_srcs[@]}" ffi/src/paged_decode_bf16.cu
fi
[ "${DECODE_ARGS:-}" = skip ] || bench decode "" --skip-prefill ${DECODE_ARGS:-}
if [ "${PREFILL_ARGS:-}" != skip ]; then
  for k in ${PREFILL_KERNELS:-auto mma}; do
    bench "prefill_$k" "JAXATTN_PREFILL_KERNEL=$k" --skip-decode ${PREFILL_ARGS:-}
  done
fi
if [ "${TESTS:-}" != skip ]; then
  tests decode_tests "" "${DECODE_K:-decode}"
  tests prefill_tests "" "${PREFILL_K:-not decode}"
  tests prefill_tests_mma "JAXATTN_PREFILL_KERNEL=mma" "${PREFILL_K:-not decode}"
  tests cascade_tests "" "${CASCADE_K:-cascade}" \
    "tests/test_kernels.py tests/test_robustness.py tests/test_ops.py"
fi

[ "${SUITES:-}" = run ] && suites

if [ "${SASS:-}" != skip ] && [ -f "$lib" ] && command -v cuobjdump > /dev/null; then
  stamp "SASS summary"
  cuobjdump --dump-sass "$lib" > "$out/sass.txt" 2>/dev/null
  python3 - "$out/sass.txt" <<'PY' | tee "$out/sass_summary.txt"
import collections, re, sys
func, counts = None, collections.defaultdict(collections.Counter)
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Function : (\S+)", line)
    if m:
        func = m.group(1)
        continue
    m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", line)
    if m and func:
        counts[func][m.group(1)] += 1
keep = ("paged_decode_mma_kernelINS_6bf16_tELi128E", "prefill_mma_kernelINS_6bf16_tELi128E",
        "prefill_sm90_kernelINS_6bf16_tELi128E", "cascade_mma_kernelINS_6bf16_tELi128E")
for f, c in counts.items():
    if any(k in f for k in keep):
        ops = {k: v for k, v in c.items() if re.match(r"(LDG|LDGSTS|LDSM|HMMA|HGMMA|MUFU|SHFL|LDL|STL|BAR)", k)}
        print(f, dict(sorted(ops.items())))
PY
fi
stamp "done"
