#!/usr/bin/env bash
# The GPU's promises, checked on a CUDA machine; logs and JSON go to $OUT (./out when unset).
#   tests    the CUDA tests (the Triton files also run under the interpreter in CI)
#   kernels  the kernel table against its byte and matmul floors (scripts/device_kernels.py)
#   e2e      the engine's end-to-end checks: greedy ids against transformers, relay against
#            --no-relay (scripts/device_e2e.py)
# Usage: bash scripts/device_check.sh [tests|kernels|e2e ...]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels e2e)
status=0
for part in "${parts[@]}"; do
  case "$part" in
    tests)
      timeout 560 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -3 ;;
    kernels)
      timeout 300 python3 scripts/device_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    e2e)
      timeout 540 python3 scripts/device_e2e.py --parts float32,bfloat16,default,wide 2>&1 | tee "$OUT/e2e.log" | tail -20 ;;
    *)
      echo "unknown part $part (tests|kernels|e2e)"; status=2; continue ;;
  esac
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
done
exit $status
