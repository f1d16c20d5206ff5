#!/usr/bin/env bash
# On the device machine (after bench/gpu/prepare.sh here, carrying gpu-run/): the CUDA tests (the
# forward grid against the f64 reference, varlen, errors; the CLI's --device cuda tests; the decode
# path's cases, FP8 caches included; the backward grid), then bench/compare_torch_cuda_decode.py
# (also with FP8 caches), bench/compare_torch_cuda.py
# and the same with --backward. Logs and JSON go to $OUT (or gpu-run/out).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-run/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
export FLASHATTN_BIN=$PWD/gpu-run/flashattn
for t in gpu-run/cuda_tests_*; do
    echo "== $t"
    "$t" --test-threads 1 --nocapture 2>&1 | tee "$out/$(basename "$t").log" | grep -E "^test |test result|panicked|CUDA device|skipping" 
done
echo "== the library's decode tests (the GPU decode test only)"
gpu-run/decode_tests_flashattn gpu:: --test-threads 1 --nocapture 2>&1 \
    | tee "$out/decode_tests_flashattn.log" | grep -E "^test |test result|panicked|skipping"
echo "== the CLI's decode and FP8 tests that use --device cuda"
gpu-run/decode_tests_flashattn-cli cuda --test-threads 1 2>&1 | tee "$out/decode_tests_cli.log" \
    | grep -E "^test |test result|panicked"
gpu-run/fp8_tests_flashattn-cli run_fp8_kv_cache bench_decode_fp8_caches_on_cuda --test-threads 1 2>&1 \
    | tee "$out/fp8_tests_cli.log" | grep -E "^test |test result|panicked"
python3 bench/compare_torch_cuda_decode.py --binary gpu-run/flashattn --out "$out/compare_cuda_decode.json" 2>&1 \
    | tee "$out/compare_cuda_decode.log"
# FP8 KV caches (q bf16) against torch's float8 -> bf16 conversion before SDPA.
python3 bench/compare_torch_cuda_decode.py --binary gpu-run/flashattn --dtype e4m3,e5m2 --rounds 2 \
    --out "$out/compare_cuda_decode_fp8.json" 2>&1 | tee "$out/compare_cuda_decode_fp8.log"
python3 bench/compare_torch_cuda.py --binary gpu-run/flashattn --out "$out/compare_cuda.json" "$@" 2>&1 \
    | tee "$out/compare_cuda.log"
# The backward (CUDA cores, not yet tensor cores): forward + backward at three lengths, d = 128.
python3 bench/compare_torch_cuda.py --binary gpu-run/flashattn --backward --quick --rounds 2 \
    --out "$out/compare_cuda_bwd.json" 2>&1 | tee "$out/compare_cuda_bwd.log"
