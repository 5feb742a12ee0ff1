#!/usr/bin/env bash
# Every GPU check and benchmark of the project in stages that fit a time-limited GPU job
# on one GPU. Results (logs, JSON) land in $OUT (default ./gpu_out).
#
#   STAGES="tests decode extend" bash benchmarks/gpu_all.sh
#   STAGES="engine pagetable" bash benchmarks/gpu_all.sh
#   STAGES="fp8" bash benchmarks/gpu_all.sh      # FP8 caches: GPU tests, decode, prefill, accuracy
#   STAGES="engine-options" bash benchmarks/gpu_all.sh   # the engine's cascade and FP8 pool
#   STAGES="issues" bash benchmarks/gpu_all.sh   # every open issue's target rows (below)
#
# "issues" is the stages issue-decode (the decode rows of the Mosaic GPU and FP8 issues: 32/8
# and 32/32, bf16 and e4m3, B x ctx 64 x 4096, 8 x 4096, 1 x 32768; then e4m3 64 x 4096 split
# at 2048 beside the rule's choice), issue-cascade (shared / mixed / private batches against
# paged decode and the read floor), issue-step (the 1B and 8B decode steps at batch 1 and 64)
# and issue-prefill (the prefill rows, bf16 and e4m3; FA4 beside them when $FA4_SITE names the
# site directory that benchmarks/fa4_peer.py describes); each stage's time limits add up to at
# most ~9 minutes, so a stage fits a 10-minute job.
#
# The native CUDA library is taken from $JAXATTN_NATIVE_LIB_DIR when it is set (built
# elsewhere with `cmake -S . -B build/gpu -DJAXATTN_CUDA=ON -DJAXATTN_CUDA_ARCHS=90`),
# otherwise from the installed package.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONWARNINGS="ignore::DeprecationWarning"
if [ -n "${JAXATTN_NATIVE_LIB_DIR:-}" ]; then
  JAXATTN_NATIVE_LIB_DIR="$(cd "$JAXATTN_NATIVE_LIB_DIR" && pwd)"
  export JAXATTN_NATIVE_LIB_DIR
fi
OUT="${OUT:-$PWD/gpu_out}"
# Test workers: one per ~10 GiB of GPU memory, at most 12 (each holds its cases' spec on the
# GPU, up to ~3.5 GiB; 12 ran out of an 80 GB card's memory).
if [ -z "${WORKERS:-}" ]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  case "$mib" in
    "" | *[!0-9]*) WORKERS=12 ;;  # memory unknown (no nvidia-smi)
    *) WORKERS=$(( mib / 10240 < 1 ? 1 : (mib / 10240 > 12 ? 12 : mib / 10240) )) ;;
  esac
fi
STAGES="${STAGES:-tests decode extend engine pagetable}"
STAGES="${STAGES//issues/issue-decode issue-cascade issue-step issue-prefill}"
mkdir -p "$OUT"
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0))s] $*"; }

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, jaxattn.native as n; print('jax', jax.__version__, jax.devices(), 'native', n.is_available())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for stage in $STAGES; do
  stamp "stage $stage"
  case $stage in
    tests)  # compiled Pallas twins, every native case on the GPU, public ops
      timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -n "$WORKERS" -p no:cacheprovider \
        --tb=short tests/test_native.py tests/test_ops.py \
        "tests/test_pallas.py" -k "not Interpret" > "$OUT/tests.log" 2>&1
      echo "tests rc=$?"; tail -n 12 "$OUT/tests.log" ;;
    decode)
      timeout "${DECODE_TIMEOUT:-190}" python3 benchmarks/bench_decode.py --check \
        --impl reference,pallas,native --samples 7 --target-s 0.03 --json "$OUT/decode.json" \
        > "$OUT/decode.log" 2>&1
      echo "decode rc=$?"; sed -n '/^| B /,$p' "$OUT/decode.log"; grep -E "ERROR|ceiling" "$OUT/decode.log" | head ;;
    extend)
      timeout "${EXTEND_TIMEOUT:-150}" python3 benchmarks/bench_extend.py --check \
        --impl pallas,native --samples 7 --target-s 0.03 --json "$OUT/extend.json" \
        > "$OUT/extend.log" 2>&1
      echo "extend rc=$?"; sed -n '/^| B x/,$p' "$OUT/extend.log"; grep -E "ERROR|ceiling" "$OUT/extend.log" | head ;;
    engine)
      timeout "${ENGINE_TIMEOUT:-200}" python3 benchmarks/bench_engine.py --preset 1b \
        --num-pages 8192 --max-batch-tokens 2048 --json "$OUT/engine.json" > "$OUT/engine.log" 2>&1
      echo "engine rc=$?"; tail -n 12 "$OUT/engine.log" ;;
    fp8)  # FP8 KV caches: the kernel suite's fp8 cases compiled, timings against bf16, accuracy
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -n "$WORKERS" -p no:cacheprovider \
        --tb=short tests/test_kernels.py -k "fp8 or every" > "$OUT/fp8_tests.log" 2>&1
      echo "fp8 tests rc=$?"; tail -n 12 "$OUT/fp8_tests.log"
      timeout "${DECODE_TIMEOUT:-300}" python3 benchmarks/bench_decode.py --check \
        --impl pallas,native --kv-dtype bfloat16,float8_e4m3fn,float8_e5m2 --heads 32/8 \
        --samples 7 --target-s 0.03 --json "$OUT/decode_fp8.json" > "$OUT/decode_fp8.log" 2>&1
      echo "decode fp8 rc=$?"; sed -n '/^| B /,$p' "$OUT/decode_fp8.log"
      timeout "${EXTEND_TIMEOUT:-200}" python3 benchmarks/bench_extend.py --check --form prefill \
        --impl pallas,native --kv-dtype bfloat16,float8_e4m3fn,float8_e5m2 --cases 8:2048:512 \
        --samples 7 --target-s 0.03 --json "$OUT/prefill_fp8.json" > "$OUT/prefill_fp8.log" 2>&1
      echo "prefill fp8 rc=$?"; sed -n '/^| B x/,$p' "$OUT/prefill_fp8.log"
      timeout "${ACCURACY_TIMEOUT:-200}" python3 benchmarks/fp8_accuracy.py --impl native,pallas \
        --json "$OUT/fp8_accuracy.json" > "$OUT/fp8_accuracy.log" 2>&1
      echo "fp8 accuracy rc=$?"; sed -n '/^| data/,$p' "$OUT/fp8_accuracy.log"
      timeout "${PARITY_TIMEOUT:-300}" python3 benchmarks/fp8_parity.py --steps 1500 \
        --json "$OUT/fp8_parity.json" > "$OUT/fp8_parity.log" 2>&1
      echo "fp8 parity rc=$?"; sed -n '/^held-out/,$p' "$OUT/fp8_parity.log" ;;
    engine-options)  # cascade decode off / on, then an FP8 pool, each against the same workload
      for opt in "--cascade off" "--cascade on --cascade-min-tokens 64" "--kv-dtype fp8_e4m3"; do
        tag=$(echo "$opt" | tr -c 'a-z0-9' '_')
        timeout "${ENGINE_TIMEOUT:-200}" python3 benchmarks/bench_engine.py --preset 1b \
          --num-pages 8192 --max-batch-tokens 2048 --modes on $opt \
          --json "$OUT/engine$tag.json" > "$OUT/engine$tag.log" 2>&1
        echo "engine $opt rc=$?"; sed -n '/^| mode | req/,/^$/p' "$OUT/engine$tag.log"
      done
      timeout "${STEP_TIMEOUT:-200}" python3 benchmarks/bench_step.py --preset 1b --batch 1,64 \
        --modes multistep --kv-dtype fp8_e4m3 --json "$OUT/step_fp8.json" > "$OUT/step_fp8.log" 2>&1
      echo "step fp8 rc=$?"; sed -n '/^| mode/,$p' "$OUT/step_fp8.log" ;;
    issue-decode)
      timeout "${DECODE_TIMEOUT:-360}" python3 benchmarks/bench_decode.py --impl native,pallas \
        --no-peers --samples 5 --target-s 0.02 --timing graph --heads 32/8,32/32 \
        --kv-dtype bfloat16,float8_e4m3fn --cases 64:4096,8:4096,1:32768 \
        --json "$OUT/issue_decode.json" > "$OUT/issue_decode.log" 2>&1
      echo "issue decode rc=$?"; sed -n '/^| B /,$p' "$OUT/issue_decode.log"
      grep -E "ERROR|ceiling" "$OUT/issue_decode.log" | head
      timeout "${SPLIT_TIMEOUT:-150}" python3 benchmarks/bench_decode.py --impl native \
        --no-peers --samples 5 --target-s 0.02 --timing graph --heads 32/8 --partitions 2048 \
        --kv-dtype bfloat16,float8_e4m3fn --cases 64:4096 --json "$OUT/issue_decode_split.json" \
        > "$OUT/issue_decode_split.log" 2>&1
      echo "issue decode split rc=$?"; sed -n '/^| B /,$p' "$OUT/issue_decode_split.log" ;;
    issue-cascade)
      timeout "${CASCADE_TIMEOUT:-300}" python3 benchmarks/bench_cascade.py --impl native,pallas \
        --batches shared,mixed,private --timing graph --samples 5 --target-s 0.03 \
        --json "$OUT/issue_cascade.json" > "$OUT/issue_cascade.log" 2>&1
      echo "issue cascade rc=$?"; sed -n '/^| batch/,$p' "$OUT/issue_cascade.log"
      grep -E "ERROR|ceiling|floor" "$OUT/issue_cascade.log" | head ;;
    issue-step)
      for preset in 1b 8b; do
        timeout "${STEP_TIMEOUT:-250}" python3 benchmarks/bench_step.py --preset "$preset" \
          --batch 1,64 --modes multistep --json "$OUT/issue_step_$preset.json" \
          > "$OUT/issue_step_$preset.log" 2>&1
        echo "issue step $preset rc=$?"; sed -n '/^| mode/,$p' "$OUT/issue_step_$preset.log"
      done ;;
    issue-prefill)
      peers=(--no-peers)
      [ -n "${FA4_SITE:-}" ] && peers=(--peer-site "$FA4_SITE")
      timeout "${EXTEND_TIMEOUT:-400}" python3 benchmarks/bench_extend.py --form prefill \
        --impl native,pallas --kv-dtype bfloat16,float8_e4m3fn --samples 5 --target-s 0.03 \
        "${peers[@]}" --json "$OUT/issue_prefill.json" > "$OUT/issue_prefill.log" 2>&1
      echo "issue prefill rc=$?"; sed -n '/^| B x/,$p' "$OUT/issue_prefill.log"
      grep -E "ERROR|ceiling" "$OUT/issue_prefill.log" | head ;;
    pagetable)
      timeout "${PAGETABLE_TIMEOUT:-90}" python3 benchmarks/bench_page_table.py --batch 64 \
        --prompt-len 500 --steps 50 --dtype bfloat16 --num-q-heads 32 --num-kv-heads 8 \
        --head-dim 128 --json "$OUT/page_table.json" > "$OUT/page_table.log" 2>&1
      echo "pagetable rc=$?"; tail -n 8 "$OUT/page_table.log" ;;
  esac
done
stamp done
