#!/usr/bin/env bash
# On the device machine (after bench/gpu/prepare.sh here, carrying gpu-run/):
#
#   bash bench/gpu/run.sh [STAGE] [args for compare_torch_cuda.py]
#
# STAGE (default all; the device tool stops a command after 10 minutes, so a session runs the
# stages as separate calls):
#   tests     the CUDA tests: the library's (forward grid against the f64 reference, varlen,
#             errors, the backward grid with its dropout cases) and the CLI's --device cuda tests;
#             the decode path's GPU cases (FP8 caches included); the FP8 forward's GPU cases;
#             the CLI's decode and FP8 tests that use --device cuda
#   decode    bench/compare_torch_cuda_decode.py (bf16, f32), then with FP8 caches (e4m3, e5m2)
#   forward   bench/compare_torch_cuda.py (flashattn vs PyTorch SDPA's flash backend)
#   backward  bench/compare_torch_cuda.py --backward --quick
#   fp8       bench/compare_torch_cuda.py --dtype e4m3 and e5m2 --quick (the FP8 forward against
#             PyTorch's float8 -> bf16 conversion and SDPA)
#   all       the five in order
# Logs and JSON collect in $LOGS (default /tmp/flashattn-gpu-logs, which outlives the calls
# while the machine stays warm; gpu-run/ itself is replaced by every carry). Each call ends by
# packing them all into $OUT/gpu-logs.tgz and writing $OUT/summary.txt (the test results and
# the comparison lines), since the tool brings back at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=${1:-all}
[ $# -gt 0 ] && shift
case "$stage" in
    tests | decode | forward | backward | fp8 | all) ;;
    *) echo "unknown stage $stage (tests, decode, forward, backward, fp8, all)" >&2; exit 2 ;;
esac
logs=${LOGS:-/tmp/flashattn-gpu-logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
export FLASHATTN_BIN=$PWD/gpu-run/flashattn
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$logs/gpu.txt"

run_tests() {
    # shellcheck source=bench/gpu/tests.sh
    . bench/gpu/tests.sh
    for entry in "${GPU_TESTS[@]}"; do
        local name=${entry%%|*}
        echo "== $name"
        # shellcheck disable=SC2086 # the command's words
        ${entry#*|} 2>&1 | tee "$logs/$name.log" \
            | grep -E "^test |test result|panicked|CUDA device|skipping|cases on"
    done
}

run_decode() {
    python3 bench/compare_torch_cuda_decode.py --binary gpu-run/flashattn \
        --out "$logs/compare_cuda_decode.json" 2>&1 | tee "$logs/compare_cuda_decode.log"
    # FP8 KV caches (q bf16) against torch's float8 -> bf16 conversion before SDPA.
    python3 bench/compare_torch_cuda_decode.py --binary gpu-run/flashattn --dtype e4m3,e5m2 --rounds 2 \
        --out "$logs/compare_cuda_decode_fp8.json" 2>&1 | tee "$logs/compare_cuda_decode_fp8.log"
}

run_forward() {
    python3 bench/compare_torch_cuda.py --binary gpu-run/flashattn --out "$logs/compare_cuda.json" "$@" \
        2>&1 | tee "$logs/compare_cuda.log"
}

run_backward() {
    # The backward: forward + backward at three lengths, d = 128.
    python3 bench/compare_torch_cuda.py --binary gpu-run/flashattn --backward --quick --rounds 2 \
        --out "$logs/compare_cuda_bwd.json" 2>&1 | tee "$logs/compare_cuda_bwd.log"
}

run_fp8() {
    for f in e4m3 e5m2; do
        python3 bench/compare_torch_cuda.py --binary gpu-run/flashattn --dtype $f --quick --rounds 2 \
            --out "$logs/compare_cuda_$f.json" 2>&1 | tee "$logs/compare_cuda_$f.log"
    done
}

case "$stage" in
    tests) run_tests ;;
    decode) run_decode ;;
    forward) run_forward "$@" ;;
    backward) run_backward ;;
    fp8) run_fp8 ;;
    all) run_tests; run_decode; run_forward "$@"; run_backward; run_fp8 ;;
esac

if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-logs.tgz" -C "$logs" .
    {
        cat "$logs/gpu.txt"
        for f in "$logs"/*.log; do
            echo "== $(basename "$f")"
            grep -E "^test |test result|panicked|skipping|^(bf16|f32|e4m3|e5m2|f16) |x[0-9.]+|device " "$f" | tail -80
        done
    } > "$OUT/summary.txt"
fi
