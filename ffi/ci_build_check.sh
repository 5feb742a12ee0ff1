#!/usr/bin/env bash
# Compile every GPU source as a CUDA build and as a ROCm/DCU build would, warnings as errors,
# on a machine without a GPU: nvcc for sm_90 (the *_sm90*.cu wgmma sources for sm_90a alone, as
# the library builds them; the other sources with JAXATTN_HAVE_SM90A as well), hipcc
# (HIP_PLATFORM=amd) for gfx906 and gfx90a (the sm_90a sources are not part of the HIP library).
# Fails on any compiler warning, on register spills in the nvcc resource report, and on
# ptxas serialising wgmma instructions.
#
#   ffi/ci_build_check.sh            # both compilers (a missing one is an error)
#   ffi/ci_build_check.sh nvcc       # or hipcc: one of them
#
# Environment: NVCC, HIPCC (compiler paths), JAXATTN_CHECK_DIR (keep the objects and logs
# there), JOBS (parallel compiles; default: number of CPUs).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
which="${1:-all}"
jobs="${JOBS:-$(nproc)}"
out="${JAXATTN_CHECK_DIR:-$(mktemp -d)}"
mkdir -p "$out"
xla_inc="$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')"
# Longest compiles first, so that the parallel jobs end together.
sources=(paged_decode_bf16 paged_decode_bf16_e4m3 paged_decode_f16 paged_decode_bf16_e5m2
  paged_decode_f16_e4m3 paged_decode_f16_e5m2 paged_decode_f32 ffi_gpu cascade prefill_fp8
  prefill linear kv_write paged_decode)
cuda_only=(prefill_sm90_persistent prefill_sm90 cascade_sm90)
includes=(-I"$here/include" -I"$here/src" -isystem "$xla_inc")

check_nvcc() {
  local nvcc="${NVCC:-nvcc}"
  command -v "$nvcc" >/dev/null || { echo "nvcc not found" >&2; return 1; }
  echo "== nvcc $("$nvcc" --version | tail -1) -> sm_90, sm_90a (*_sm90*)"
  printf '%s\n' "${cuda_only[@]}" "${sources[@]}" | xargs -P "$jobs" -I{} sh -c \
    "case {} in *_sm90*) arch='-gencode=arch=compute_90a,code=sm_90a' ;; \
       *) arch='-arch=sm_90 -DJAXATTN_HAVE_SM90A' ;; esac; \
     \"$nvcc\" -std=c++17 -O3 \$arch -Werror all-warnings \
       -Xcompiler -Wall,-Wextra,-Werror -Xptxas -v ${includes[*]} \
       -c \"$here/src/{}.cu\" -o \"$out/{}.cuda.o\" > \"$out/{}.nvcc.log\" 2>&1 \
     || { cat \"$out/{}.nvcc.log\"; exit 1; }"
  local spills serial
  spills="$(cat "$out"/*.nvcc.log | grep -c -E '[1-9][0-9]* bytes spill (stores|loads)' || true)"
  serial="$(cat "$out"/*.nvcc.log | grep -c 'wgmma.mma_async instructions are serialized' || true)"
  echo "   kernels compiled: $(cat "$out"/*.nvcc.log | grep -c 'Compiling entry function'); with spills: $spills; serialised wgmma: $serial"
  [ "$spills" = 0 ] || { grep -B3 -E '[1-9][0-9]* bytes spill' "$out"/*.nvcc.log; return 1; }
  [ "$serial" = 0 ] || { grep 'wgmma.mma_async instructions are serialized' "$out"/*.nvcc.log; return 1; }
}

check_hipcc() {
  local hipcc="${HIPCC:-hipcc}"
  command -v "$hipcc" >/dev/null || { echo "hipcc not found" >&2; return 1; }
  echo "== hipcc ($("$hipcc" --version 2>/dev/null | head -1)) -> gfx906, gfx90a"
  printf '%s\n' "${sources[@]}" | HIP_PLATFORM=amd xargs -P "$jobs" -I{} sh -c \
    "\"$hipcc\" -std=c++17 -O3 -x hip --offload-arch=gfx906 --offload-arch=gfx90a \
       -Wall -Wextra -Werror ${includes[*]} \
       -c \"$here/src/{}.cu\" -o \"$out/{}.hip.o\" > \"$out/{}.hipcc.log\" 2>&1 \
     || { cat \"$out/{}.hipcc.log\"; exit 1; }"
  echo "   objects: $(ls "$out"/*.hip.o | wc -l)"
}

case "$which" in
  nvcc) check_nvcc ;;
  hipcc) check_hipcc ;;
  # Two commands, not `check_nvcc && check_hipcc`: bash ignores errexit inside a function
  # called from a && list, so a failed nvcc check would fall through to "compile cleanly".
  all)
    check_nvcc
    check_hipcc
    ;;
  *) echo "usage: $0 [nvcc|hipcc|all]" >&2; exit 2 ;;
esac
echo "GPU sources compile cleanly (logs in $out)"
