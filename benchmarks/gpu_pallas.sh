#!/usr/bin/env bash
# Pallas kernels on a GPU: the compiled test twins, then the decode and extend
# benchmarks (with tile sweeps). Results land in $OUT (default: ./gpu_pallas_out).
#
#   bash benchmarks/gpu_pallas.sh            # tests + benchmarks + sweeps (~5 min on an H200)
#   STAGES="decode extend" bash benchmarks/gpu_pallas.sh   # any of: tests decode extend
#   DECODE_ARGS="--impl pallas --no-peers" EXTEND_ARGS="..."  # replace the defaults
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# jax >= 0.11 warns at every Triton lowering that the backend is deprecated.
export PYTHONWARNINGS="ignore::DeprecationWarning"
OUT="${OUT:-$PWD/gpu_pallas_out}"
STAGES="${STAGES:-tests decode extend}"
SAMPLES="${SAMPLES:-7}"
PY="${PY:-python3}"
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

for stage in $STAGES; do
  start=$SECONDS
  case $stage in
    tests)
      # Triton compiles dominate: spread them over processes when xdist is there.
      par=""; "$PY" -c "import xdist" 2>/dev/null && par="-n ${WORKERS:-4}"
      timeout 120 "$PY" -m pytest tests/test_pallas.py -q $par -p no:cacheprovider --tb=short \
        -k "Compiled or through_ops or heuristic or refuses or rejects" \
        > "$OUT/tests.log" 2>&1
      echo "tests rc=$?"; tail -n 15 "$OUT/tests.log" ;;
    decode)
      timeout 210 "$PY" benchmarks/bench_decode.py --check --sweep --samples "$SAMPLES" \
        --target-s 0.03 ${DECODE_ARGS:---impl reference,pallas,native} --json "$OUT/decode.json" \
        > "$OUT/decode.log" 2>&1
      echo "decode rc=$?"; sed -n '/^| B /,$p' "$OUT/decode.log"
      grep -E "ERROR" "$OUT/decode.log" | head -20 ;;
    extend)
      timeout 150 "$PY" benchmarks/bench_extend.py --check --sweep --samples "$SAMPLES" \
        --target-s 0.03 ${EXTEND_ARGS:---impl pallas,native} --json "$OUT/extend.json" \
        > "$OUT/extend.log" 2>&1
      echo "extend rc=$?"; sed -n '/^| B x/,$p' "$OUT/extend.log"
      grep -E "ERROR|no check" "$OUT/extend.log" | head -20 ;;
  esac
  echo "stage $stage: $((SECONDS - start)) s"
done
