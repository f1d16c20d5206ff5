#!/usr/bin/env bash
# One device call that does what a short GPU lease can afford, most important first, each stage
# under its own time limit so the script ends (and packs its logs) before the tool's limit:
#
#   1. the environment: GPU, driver, which NVRTC (the kernel disk cache carried in
#      gpu-run/cache_sm90a.tar.xz was filled here with NVRTC 13.0 by `flashattn compile`; it is used
#      when the NVRTC found there is 13.0 too, else the kernels compile on the 16 cores first);
#   2. the CUDA tests, the binaries side by side (the correctness record);
#   3. flashattn vs PyTorch SDPA: forward (bf16, d = 128, --quick), the decode step (bf16, f32),
#      forward + backward (--quick), as the time left allows;
#   4. NVRTC's own compile rate there (a few variants into an empty cache).
#
# Here: bash bench/gpu/prepare.sh && the cache (see docs/CUDA.md); there (carry gpu-run):
#   bash bench/gpu/session.sh [SECONDS] [decode|h100|ab|quick|fwd|bwd|bwdprobe|python|sm90|sm90b|sm90fp8|sm90bwd|owed]
# SECONDS: the budget for the whole script (500). `bwd`: after the tests, forward + backward
# against SDPA (this build beside gpu-run/old/flashattn when carried) and the backward kernels
# under Nsight Compute; `bwdprobe`: the same without the tests (a profile to work from).
# `decode`: after the tests, only the decode comparisons (the default CUDA-core split kernel,
# then the tensor-core one with FLASHATTN_CUDA_DECODE=tc), an Nsight Compute summary of each split
# kernel and a split-count sweep of the tensor-core one at the decode benchmark shape (for work on
# decode.cu).
# `sm90`: the Hopper forward (fwd_sm90.cu): probe, its test grids, against fwd.cu and SDPA.
# `sm90b`: the warp-specialised fwd_sm90_ws.cu: its grids (persistent, one also with one CTA per
# tile and one with pingpong), against fwd_sm90.cu, fwd.cu, SDPA, persistent on and off; Python.
# `sm90fp8`: the FP8 fwd_sm90_fp8.cu (FLASHATTN_CUDA_FWD=sm90fp8) and fwd_sm90_ws.cu's FP8 mode
# (FLASHATTN_CUDA_FWD=sm90fp8ws): the FP8 tests on each (fwd_sm90_fp8.cu with overlap on and off),
# then e4m3 on them, fwd_sm90_fp8.cu with and without the overlap, against e4m3 on fwd.cu and the
# bf16 kernels (fwd_sm90.cu, SDPA).
# `sm90bwd`: the sm_90a backward (bwd_sm90.cu, opt-in with FLASHATTN_SM90_BWD=1): the GPU
# gradient tests on it (f16/bf16 grids, sinks, the `_into` forms), which kernels a call runs,
# then forward + backward on it against bwd.cu and SDPA's flash and cuDNN backends.
# `owed`: every kernel path compiled and emulated but not yet run on a GPU (the warp-specialised
# forward with static and dynamic tile scheduling, its FP8 mode with per-block factors too,
# fwd_sm90_fp8.cu, bwd_sm90.cu, the `_into` forms, the Python CUDA tests), in parallel, then one
# short timing of each against SDPA: the first thing to run on a new lease.
# `python`: no Rust tests: the wgmma layout probe (bench/gpu/wgmma_probe.py), then the Python
# package on CUDA tensors (its tests and benchmark).
# $OUT/summary.txt grows as stages end; $OUT/logs.tgz holds every log at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
budget=${1:-500}
mode=${2:-all}
t0=$(date +%s)
left() { echo $((budget - ($(date +%s) - t0))); }
out=${OUT:-/tmp/flashattn-out}
logs=/tmp/flashattn-gpu-logs
mkdir -p "$out" "$logs"
summary=$out/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
export PYTHONUNBUFFERED=1
export FLASHATTN_CACHE_DIR=/tmp/flashattn-cache
bin=$PWD/gpu-run/flashattn
export FLASHATTN_BIN=$bin

say "== $(date -u +%FT%TZ) environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$summary"
nproc | sed 's/^/cpus: /' | tee -a "$summary"
python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1 | tee -a "$summary"

# NVRTC: the first library that reports 13.0 (what the carried cache was built with).
nvrtc=""
for cand in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; [print(os.path.join(p, "cu13", "lib")) for p in nvidia.__path__]' 2>/dev/null); do
    [ -e "$cand" ] || continue
    v=$(FLASHATTN_NVRTC=$cand FLASHATTN_CACHE_DIR=/tmp/none "$bin" compile --filter no-such-kernel 2>&1 | head -1)
    say "nvrtc candidate $cand: $v"
    if [ -z "$nvrtc" ] && [[ $v == "NVRTC 13.0:"* ]]; then nvrtc=$cand; fi
done
if [ -n "$nvrtc" ]; then
    export FLASHATTN_NVRTC=$nvrtc
    mkdir -p "$FLASHATTN_CACHE_DIR"
    # Python's tarfile reads xz whether or not the machine has the xz tool.
    python3 - gpu-run/cache_sm90a.tar.xz "$FLASHATTN_CACHE_DIR" <<'PY' && say "cache: $(ls "$FLASHATTN_CACHE_DIR" | wc -l) cubins unpacked, NVRTC $nvrtc"
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    try:
        t.extractall(sys.argv[2], filter="data")
    except TypeError:  # a Python without extraction filters
        t.extractall(sys.argv[2])
PY
else
    say "no NVRTC 13.0 found: compiling every variant here first"
    timeout 200 "$bin" compile 2>&1 | tail -5 | tee -a "$summary"
fi

if [ "$mode" != bwdprobe ] && [ "$mode" != python ] && [ "$mode" != sm90 ] && [ "$mode" != sm90fp8 ] \
    && [ "$mode" != sm90bwd ] && [ "$mode" != owed ]; then
say "== $(date -u +%T) tests ($(left) s left)"
tl=$(( $(left) - 220 )); [ $tl -gt 280 ] && tl=280; [ $tl -lt 60 ] && tl=60
# shellcheck source=bench/gpu/tests.sh
. bench/gpu/tests.sh
for entry in "${GPU_TESTS[@]}"; do
    name=${entry%%|*}
    # `quick`: only the decode and FP8 test runs (seconds each), not the forward/backward grids.
    if [ "$mode" = quick ] && [[ $name != decode_* && $name != fp8_* ]]; then continue; fi
    # shellcheck disable=SC2086 # the command's words
    (timeout "$tl" ${entry#*|} >"$logs/$name.log" 2>&1; echo "exit $?" >>"$logs/$name.log") &
done
wait
for f in "$logs"/*_tests_*.log; do
    say "-- $(basename "$f")"
    grep -E "^test |test result|panicked|CUDA device|skipping|cases on|^exit " "$f" | head -60 | tee -a "$summary"
done
fi

summarise() { # pattern, logs...: each log's name, then its lines matching the pattern (12 at most)
    local pattern=$1 f
    shift
    for f in "$@"; do
        say "-- $(basename "$f")"
        grep -E "$pattern" "$f" | head -12 | tee -a "$summary"
    done
}
python_tests() { # seconds wanted, stage name: the Python package's CUDA tests, when a wheel came
    ls gpu-run/flashattn-*.whl >/dev/null 2>&1 || return 0
    python3 -m pip install -q --no-index --no-deps --target /tmp/flashattn-py gpu-run/flashattn-*.whl
    stage "$1" "$2" env FLASHATTN_PY_CUDA=1 PYTHONPATH=/tmp/flashattn-py \
        python3 -m pytest -q -rs -p no:cacheprovider flashattn-py/tests/test_cuda.py
}
python_stage() { # the Python package on CUDA tensors: its CUDA tests, then its benchmark
    ls gpu-run/flashattn-*.whl >/dev/null 2>&1 || { say "== no wheel in gpu-run: python skipped"; return; }
    python_tests 90 python_cuda_tests
    stage 90 python_cuda_bench env FLASHATTN_PY_CUDA=1 PYTHONPATH=/tmp/flashattn-py \
        python3 -m flashattn.bench --device cuda --seqlen 2048 4096 --head-dim 64 128 --dtype bf16 \
        --rounds 3 --json "$logs/python_cuda_bench.json"
}
stage() { # seconds wanted, name, command...
    local want=$1 name=$2; shift 2
    local l; l=$(left)
    if [ "$l" -lt $((want / 2 + 20)) ]; then say "== skipped $name ($l s left)"; return; fi
    [ "$want" -gt $((l - 20)) ] && want=$((l - 20))
    say "== $(date -u +%T) $name (limit $want s)"
    timeout "$want" "$@" >"$logs/$name.log" 2>&1
    echo "exit $?" >>"$logs/$name.log"
    grep -vE "^\s*$" "$logs/$name.log" | tail -25 | tee -a "$summary"
}
finish() { # the summary's last line, every log packed, the JSON beside it; ends the script
    say "== $(date -u +%T) done, $(left) s of $budget left"
    tar czf "$out/logs.tgz" -C "$logs" . 2>/dev/null
    cp "$logs"/*.json "$out"/ 2>/dev/null || true
    exit 0
}
ab_rounds() { # rounds: this build against gpu-run/old/flashattn (when carried), call by call on
    # the same warm GPU: the decode step at the decode benchmark shape and a 4k cache, both dtypes
    local round which b
    for round in $(seq "$1"); do
        for which in old new; do
            b=$bin; [ $which = old ] && b=$PWD/gpu-run/old/flashattn
            [ -x "$b" ] || continue
            stage 12 "ab_${which}_$round" env FLASHATTN_CUDA_DECODE=tc "$b" bench --decode \
                --device cuda --batch 1 --heads 32 --heads-kv 8 --head-dim 128 \
                --cache-len 4096,32768 --min-time 0.2
        done
    done
}
if [ "$mode" = sm90 ]; then
    # The sm_90a forward (fwd_sm90.cu): the layout probe, the forward test grids on it, the Python
    # package's CUDA tests, then fwd.cu, fwd_sm90.cu and SDPA's flash and cuDNN backends in the
    # same rounds, and where the Python package's CUDA calls spend their time.
    stage 40 wgmma_probe python3 bench/gpu/wgmma_probe.py
    for t in grid_bf16 grid_f16 varlen_matches_reference sinks_match_reference; do
        (timeout 120 gpu-run/integration_tests_flashattn "cuda::device::$t" --exact \
            --nocapture >"$logs/sm90_$t.log" 2>&1; echo "exit $?" >>"$logs/sm90_$t.log") &
    done
    wait
    summarise "test result|panicked|cases per forward kernel|error too large|^exit " "$logs"/sm90_*.log
    python_tests 50 python_cuda_tests
    # d = 128: fwd_sm90.cu (main, the default), without the overlap, and fwd.cu; then d = 64, 256.
    stage 150 compare_sm90_d128 python3 bench/compare_torch_cuda.py --binary "$bin" --cudnn \
        --dims 128 --seqlens 2048,8192,16384 --rounds 1 --min-time 0.2 \
        --variant "fa2=$bin,FLASHATTN_CUDA_FWD=fa2" \
        --variant "sm90_no_overlap=$bin,FLASHATTN_SM90_OVERLAP=0" \
        --out "$logs/compare_sm90_d128.json"
    if ls gpu-run/flashattn-*.whl >/dev/null 2>&1; then
        stage 40 py_overhead env PYTHONPATH=/tmp/flashattn-py python3 bench/gpu/py_overhead.py
    fi
    stage 100 compare_sm90_d64_256 python3 bench/compare_torch_cuda.py --binary "$bin" --cudnn \
        --dims 64,256 --seqlens 8192 --rounds 1 --min-time 0.2 \
        --variant "fa2=$bin,FLASHATTN_CUDA_FWD=fa2" --out "$logs/compare_sm90_d64_256.json"
    finish
fi
if [ "$mode" = sm90b ]; then
    # The warp-specialised sm_90a forward (fwd_sm90_ws.cu): its test grids (launched persistent,
    # the default), then it beside the default (fwd_sm90.cu), fwd.cu and SDPA's flash and cuDNN
    # backends, persistent on and off (FLASHATTN_SM90_PERSISTENT=0: one CTA per work tile); the
    # Python package.
    for t in grid_bf16 grid_f16 varlen_matches_reference sinks_match_reference; do
        (FLASHATTN_CUDA_FWD=sm90ws timeout 100 gpu-run/integration_tests_flashattn "cuda::device::$t" --exact \
            --nocapture >"$logs/ws_$t.log" 2>&1; echo "exit $?" >>"$logs/ws_$t.log") &
    done
    # The pingpong variant on one grid, and one grid with one CTA per tile.
    (FLASHATTN_CUDA_FWD=sm90ws FLASHATTN_SM90_PINGPONG=1 timeout 100 gpu-run/integration_tests_flashattn \
        cuda::device::grid_bf16 --exact --nocapture >"$logs/ws_pingpong_grid_bf16.log" 2>&1
        echo "exit $?" >>"$logs/ws_pingpong_grid_bf16.log") &
    (FLASHATTN_CUDA_FWD=sm90ws FLASHATTN_SM90_PERSISTENT=0 timeout 100 gpu-run/integration_tests_flashattn \
        cuda::device::grid_f16 --exact --nocapture >"$logs/ws_nonpersistent_grid_f16.log" 2>&1
        echo "exit $?" >>"$logs/ws_nonpersistent_grid_f16.log") &
    wait
    summarise "test result|panicked|cases per forward kernel|error too large|^exit " "$logs"/ws_*.log
    # d = 128, causal and not: the causal rows show what the persistent scheduler buys.
    stage 160 compare_ws_d128 python3 bench/compare_torch_cuda.py --binary "$bin" --cudnn \
        --dims 128 --seqlens 8192 --rounds 1 --min-time 0.2 \
        --variant "sm90ws=$bin,FLASHATTN_CUDA_FWD=sm90ws" \
        --variant "sm90ws_tile_per_cta=$bin,FLASHATTN_CUDA_FWD=sm90ws,FLASHATTN_SM90_PERSISTENT=0" \
        --variant "sm90ws_pingpong=$bin,FLASHATTN_CUDA_FWD=sm90ws,FLASHATTN_SM90_PINGPONG=1" \
        --variant "fa2=$bin,FLASHATTN_CUDA_FWD=fa2" --out "$logs/compare_ws_d128.json"
    stage 100 compare_ws_d64_256 python3 bench/compare_torch_cuda.py --binary "$bin" --cudnn \
        --dims 64,256 --seqlens 8192 --causal no --rounds 1 --min-time 0.2 \
        --variant "sm90ws=$bin,FLASHATTN_CUDA_FWD=sm90ws" \
        --variant "sm90ws_pingpong=$bin,FLASHATTN_CUDA_FWD=sm90ws,FLASHATTN_SM90_PINGPONG=1" \
        --out "$logs/compare_ws_d64_256.json"
    python_tests 40 python_cuda_tests
    finish
fi
if [ "$mode" = sm90fp8 ]; then
    # The FP8 tests with e4m3 calls on fwd_sm90_fp8.cu (the e5m2 and unaligned ones stay on
    # fwd.cu; the test says how many ran where; per-block factors included:
    # fp8::gpu::fp8_per_block_on_the_gpu), the emulated FP8 kernel test beside them for
    # the record, then the timings: e4m3 on fwd_sm90_fp8.cu (variant) against e4m3 on fwd.cu
    # (main), and bf16 on the default fwd_sm90.cu against SDPA for scale.
    # The same tests without the softmax/P·V overlap (FLASHATTN_SM90_OVERLAP=0), and on the
    # warp-specialised FP8 mode (FLASHATTN_CUDA_FWD=sm90fp8ws), side by side.
    (FLASHATTN_CUDA_FWD=sm90fp8 timeout 120 gpu-run/integration_tests_flashattn fp8::gpu:: \
        --test-threads 1 --nocapture >"$logs/sm90fp8_gpu.log" 2>&1; echo "exit $?" >>"$logs/sm90fp8_gpu.log") &
    (FLASHATTN_CUDA_FWD=sm90fp8 FLASHATTN_SM90_OVERLAP=0 timeout 120 gpu-run/integration_tests_flashattn \
        fp8::gpu:: --test-threads 1 --nocapture >"$logs/sm90fp8_no_overlap_gpu.log" 2>&1
        echo "exit $?" >>"$logs/sm90fp8_no_overlap_gpu.log") &
    (FLASHATTN_CUDA_FWD=sm90fp8ws timeout 120 gpu-run/integration_tests_flashattn fp8::gpu:: \
        --test-threads 1 --nocapture >"$logs/sm90fp8ws_gpu.log" 2>&1; echo "exit $?" >>"$logs/sm90fp8ws_gpu.log") &
    wait
    summarise "test result|panicked|FP8 forward cases|out\[|^exit " \
        "$logs"/sm90fp8_gpu.log "$logs"/sm90fp8_no_overlap_gpu.log "$logs"/sm90fp8ws_gpu.log
    # Four kernels on e4m3 in the e4m3 stage: the bf16 one gives up 50 s for them (same total).
    stage 220 compare_fp8_e4m3 python3 bench/compare_torch_cuda.py --binary "$bin" --dtype e4m3 \
        --dims 128,256 --seqlens 2048,8192 --rounds 1 --min-time 0.2 \
        --variant "sm90fp8=$bin,FLASHATTN_CUDA_FWD=sm90fp8" \
        --variant "sm90fp8_no_overlap=$bin,FLASHATTN_CUDA_FWD=sm90fp8,FLASHATTN_SM90_OVERLAP=0" \
        --variant "sm90fp8ws=$bin,FLASHATTN_CUDA_FWD=sm90fp8ws" \
        --out "$logs/compare_fp8_e4m3.json"
    stage 50 compare_fp8_bf16 python3 bench/compare_torch_cuda.py --binary "$bin" --dtype bf16 \
        --dims 128,256 --seqlens 8192 --rounds 1 --min-time 0.2 --out "$logs/compare_fp8_bf16.json"
    finish
fi
if [ "$mode" = sm90bwd ]; then
    # The sm_90a backward (bwd_sm90.cu): the GPU gradient tests with FLASHATTN_SM90_BWD=1 (the
    # grids' cases with head_dim a multiple of 8 up to 128 run on it, the others on bwd.cu; every
    # case twice, bit for bit), the same with bwd.cu alone for the record, and the kernel names a
    # call reports (bwd_dq_sm90_... when it runs).
    (FLASHATTN_SM90_BWD=1 timeout 150 gpu-run/integration_tests_flashattn cuda::device::backward:: \
        --test-threads 3 --nocapture >"$logs/sm90bwd_gpu.log" 2>&1; echo "exit $?" >>"$logs/sm90bwd_gpu.log") &
    (FLASHATTN_SM90_BWD=1 timeout 150 gpu-run/integration_tests_flashattn cuda::device::into:: \
        --test-threads 2 --nocapture >"$logs/sm90bwd_into_gpu.log" 2>&1; echo "exit $?" >>"$logs/sm90bwd_into_gpu.log") &
    (timeout 150 gpu-run/integration_tests_flashattn cuda::device::backward:: --test-threads 3 \
        --nocapture >"$logs/sm90bwd_fa2_gpu.log" 2>&1; echo "exit $?" >>"$logs/sm90bwd_fa2_gpu.log") &
    wait
    summarise "test result|panicked|error too large|differs|^exit " \
        "$logs"/sm90bwd_gpu.log "$logs"/sm90bwd_into_gpu.log "$logs"/sm90bwd_fa2_gpu.log
    for d in 64 128; do
        stage 20 "sm90bwd_kernels_d$d" env FLASHATTN_SM90_BWD=1 "$bin" bench --device cuda --dtype bf16 \
            --batch 1 --heads 16 --head-dim $d --seqlen 2048 --causal --backward --no-naive --min-time 0.05
    done
    # d = 128 then 64, causal and not: bwd.cu (main), bwd_sm90.cu (variant), SDPA flash and cuDNN.
    stage 170 compare_sm90bwd_d128 python3 bench/compare_torch_cuda.py --binary "$bin" --backward \
        --cudnn --dims 128 --seqlens 2048,8192 --rounds 1 --min-time 0.2 \
        --variant "sm90bwd=$bin,FLASHATTN_SM90_BWD=1" --out "$logs/compare_sm90bwd_d128.json"
    stage 110 compare_sm90bwd_d64 python3 bench/compare_torch_cuda.py --binary "$bin" --backward \
        --cudnn --dims 64 --seqlens 8192 --rounds 1 --min-time 0.2 \
        --variant "sm90bwd=$bin,FLASHATTN_SM90_BWD=1" --out "$logs/compare_sm90bwd_d64.json"
    finish
fi
if [ "$mode" = owed ]; then
    # Everything compiled and emulated but not yet run on a GPU, correctness first, all in one
    # lease (~480 s): the test runs in parallel (the GPU has room for them), then one short timing
    # per new kernel against SDPA (flash, cuDNN) at d = 128.
    run_tests() { # log name, env..., -- test filter and flags
        local name=$1; shift
        (timeout 150 env "$@" >"$logs/owed_$name.log" 2>&1; echo "exit $?" >>"$logs/owed_$name.log") &
    }
    t=gpu-run/integration_tests_flashattn
    run_tests ws_grid FLASHATTN_CUDA_FWD=sm90ws $t cuda::device::grid_bf16 --exact --nocapture
    run_tests ws_varlen_sinks FLASHATTN_CUDA_FWD=sm90ws $t cuda::device::varlen_matches_reference \
        cuda::device::sinks_match_reference --nocapture
    run_tests ws_tile_per_cta FLASHATTN_CUDA_FWD=sm90ws FLASHATTN_SM90_PERSISTENT=0 $t \
        cuda::device::grid_f16 --exact --nocapture
    # The dynamic tile scheduler (an atomicAdd per tile), on the grid and packed sequences.
    run_tests ws_dynamic FLASHATTN_CUDA_FWD=sm90ws FLASHATTN_SM90_SCHEDULER=dynamic $t \
        cuda::device::grid_bf16 cuda::device::varlen_matches_reference --nocapture
    run_tests fp8_sm90 FLASHATTN_CUDA_FWD=sm90fp8 $t fp8::gpu:: --test-threads 1 --nocapture
    # fp8::gpu:: includes the per-block factors (fp8_per_block_on_the_gpu), on the ws kernel too.
    run_tests fp8_sm90ws FLASHATTN_CUDA_FWD=sm90fp8ws $t fp8::gpu:: --test-threads 1 --nocapture
    run_tests fp8_sm90ws_dynamic FLASHATTN_CUDA_FWD=sm90fp8ws FLASHATTN_SM90_SCHEDULER=dynamic $t \
        fp8::gpu:: --test-threads 1 --nocapture
    run_tests sm90bwd FLASHATTN_SM90_BWD=1 $t cuda::device::backward:: --test-threads 3 --nocapture
    run_tests into FLASHATTN_SM90_BWD=1 $t cuda::device::into:: --test-threads 2 --nocapture
    wait
    summarise "test result|panicked|error too large|differs|cases per forward kernel|FP8 forward cases|^exit " \
        "$logs"/owed_*.log
    python_tests 60 owed_python_cuda_tests
    stage 120 owed_fwd_d128 python3 bench/compare_torch_cuda.py --binary "$bin" --cudnn \
        --dims 128 --seqlens 8192 --rounds 1 --min-time 0.2 \
        --variant "sm90ws=$bin,FLASHATTN_CUDA_FWD=sm90ws" \
        --variant "sm90ws_tile_per_cta=$bin,FLASHATTN_CUDA_FWD=sm90ws,FLASHATTN_SM90_PERSISTENT=0" \
        --variant "sm90ws_dynamic=$bin,FLASHATTN_CUDA_FWD=sm90ws,FLASHATTN_SM90_SCHEDULER=dynamic" \
        --out "$logs/owed_fwd_d128.json"
    stage 90 owed_bwd_d128 python3 bench/compare_torch_cuda.py --binary "$bin" --backward --cudnn \
        --dims 128 --seqlens 8192 --rounds 1 --min-time 0.2 \
        --variant "sm90bwd=$bin,FLASHATTN_SM90_BWD=1" --out "$logs/owed_bwd_d128.json"
    stage 90 owed_fp8_d128 python3 bench/compare_torch_cuda.py --binary "$bin" --dtype e4m3 \
        --dims 128 --seqlens 8192 --rounds 1 --min-time 0.2 \
        --variant "sm90fp8=$bin,FLASHATTN_CUDA_FWD=sm90fp8" \
        --variant "sm90fp8ws=$bin,FLASHATTN_CUDA_FWD=sm90fp8ws" --out "$logs/owed_fp8_d128.json"
    # Per-block FP8 factors: fwd_sm90_fp8.cu against the warp-specialised FP8 mode, the same call.
    stage 40 owed_fp8_per_block bash -c "for k in sm90fp8 sm90fp8ws sm90fp8 sm90fp8ws; do \
        FLASHATTN_CUDA_FWD=\$k '$bin' bench --device cuda --dtype e4m3 --fp8-per-block \
        --seqlen 8192 --heads 16 --head-dim 128 --min-time 0.2 | tail -1; done"
    finish
fi
if [ "$mode" = python ]; then
    stage 60 wgmma_probe python3 bench/gpu/wgmma_probe.py
    python_stage
    finish
fi
if [ "$mode" = bwd ] || [ "$mode" = bwdprobe ]; then
    variants=()
    [ -x gpu-run/old/flashattn ] && variants+=(--variant "old=$PWD/gpu-run/old/flashattn")
    stage 150 compare_bwd python3 bench/compare_torch_cuda.py --binary "$bin" --backward --quick \
        --rounds 1 --min-time 0.2 "${variants[@]}" --out "$logs/compare_cuda_bwd.json"
    # One forward + backward at 4 x 4096 tokens, 16 heads, d = 128: bwd_prep, bwd_dq and
    # bwd_dkdv, each kernel's summary.
    for c in no yes; do
        cflag=(); [ $c = yes ] && cflag=(--causal)
        stage 60 "ncu_bwd_causal_$c" ncu --kernel-name regex:bwd_ --launch-count 4 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            "$bin" bench --device cuda --dtype bf16 --batch 4 --heads 16 --head-dim 128 \
            --seqlen 4096 "${cflag[@]}" --backward --no-naive --min-time 0.01
    done
    finish
fi
if [ "$mode" = decode ]; then
    stage 80 compare_decode python3 bench/compare_torch_cuda_decode.py --binary "$bin" --rounds 2 \
        --min-time 0.2 --out "$logs/compare_cuda_decode.json"
    stage 80 compare_decode_tc env FLASHATTN_CUDA_DECODE=tc python3 bench/compare_torch_cuda_decode.py \
        --binary "$bin" --rounds 2 --min-time 0.2 --out "$logs/compare_cuda_decode_tc.json"
    for kernel in tc cuda-core; do
        stage 60 "ncu_decode_$kernel" env FLASHATTN_CUDA_DECODE=$kernel ncu --kernel-name regex:decode_split \
            --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
            "$bin" bench --decode --device cuda --dtype bf16 --batch 1 --heads 32 --heads-kv 8 \
            --head-dim 128 --cache-len 32768 --min-time 0.01
    done
    for sp in 16 33 49 66 132; do
        stage 15 "splits_tc_$sp" env FLASHATTN_CUDA_DECODE=tc "$bin" bench --decode --device cuda \
            --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 \
            --min-time 0.3 --num-splits $sp
    done
    finish
fi
if [ "$mode" = quick ]; then
    # A short lease's last minutes: the decode tests above, this build against gpu-run/old (two
    # rounds), the decode kernels' durations under Nsight Compute, one round against SDPA.
    ab_rounds 2
    stage 30 ncu_decode_all ncu --kernel-name regex:decode --launch-skip 9 --launch-count 3 \
        --section SpeedOfLight "$bin" bench --decode --device cuda \
        --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 --min-time 0.01
    stage 50 compare_decode python3 bench/compare_torch_cuda_decode.py --binary "$bin" --rounds 1 \
        --min-time 0.2 --out "$logs/compare_cuda_decode.json"
    finish
fi
if [ "$mode" = ab ]; then
    # A build against the one before it (gpu-run/old/flashattn, carried beside), 3 rounds, then
    # decode vs SDPA, the three decode kernels under Nsight Compute, forward + backward vs SDPA.
    ab_rounds 3
    stage 70 compare_decode python3 bench/compare_torch_cuda_decode.py --binary "$bin" --rounds 2 \
        --min-time 0.2 --out "$logs/compare_cuda_decode.json"
    stage 35 ncu_decode_all ncu --kernel-name regex:decode --launch-skip 9 --launch-count 3 \
        --section SpeedOfLight --section LaunchStats "$bin" bench --decode --device cuda \
        --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 --min-time 0.01
    stage 100 compare_bwd python3 bench/compare_torch_cuda.py --binary "$bin" --backward --quick \
        --rounds 1 --min-time 0.2 --out "$logs/compare_cuda_bwd.json"
    finish
fi
if [ "$mode" = fwd ]; then
    # A forward kernel change: after the tests, this build against gpu-run/old/flashattn (when
    # carried) call by call beside SDPA (d = 128, 512 to 16k tokens, causal or not; one round, as
    # each flashattn call with its data set-up and error check takes ~10 s there: two rounds of
    # d = 64 and 128 got through 3 of 12 shapes in 150 s), then the decode step
    # against SDPA.
    variants=()
    [ -x gpu-run/old/flashattn ] && variants+=(--variant "old=$PWD/gpu-run/old/flashattn")
    stage 180 compare_fwd_ab python3 bench/compare_torch_cuda.py --binary "$bin" --quick --rounds 1 \
        --min-time 0.2 "${variants[@]}" --out "$logs/compare_cuda_fwd_ab.json"
    stage 60 compare_decode python3 bench/compare_torch_cuda_decode.py --binary "$bin" --rounds 1 \
        --min-time 0.2 --out "$logs/compare_cuda_decode.json"
    finish
fi
if [ "$mode" = h100 ]; then
    # The tensor-core decode kernel's first GPU run first, the default beside it, a split sweep,
    # then the forward against SDPA and one Nsight Compute summary of each (for offline work).
    stage 70 compare_decode_tc env FLASHATTN_CUDA_DECODE=tc python3 bench/compare_torch_cuda_decode.py \
        --binary "$bin" --rounds 2 --min-time 0.2 --out "$logs/compare_cuda_decode_tc.json"
    stage 70 compare_decode python3 bench/compare_torch_cuda_decode.py --binary "$bin" --rounds 2 \
        --min-time 0.2 --out "$logs/compare_cuda_decode.json"
    for sp in 33 49 66 98; do
        stage 12 "splits_tc_$sp" env FLASHATTN_CUDA_DECODE=tc "$bin" bench --decode --device cuda \
            --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 \
            --min-time 0.3 --num-splits $sp
    done
    stage 45 ncu_decode_tc env FLASHATTN_CUDA_DECODE=tc ncu --kernel-name regex:decode_split \
        --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
        "$bin" bench --decode --device cuda --dtype bf16 --batch 1 --heads 32 --heads-kv 8 \
        --head-dim 128 --cache-len 32768 --min-time 0.01
    stage 110 compare_fwd python3 bench/compare_torch_cuda.py --binary "$bin" --quick --rounds 2 \
        --min-time 0.2 --out "$logs/compare_cuda_fwd.json"
    stage 45 ncu_fwd ncu --kernel-name regex:flash_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis \
        "$bin" bench --device cuda --dtype bf16 --batch 4 --heads 16 --head-dim 128 --seqlen 4096 \
        --no-naive --min-time 0.01
    finish
fi
python_stage
stage 140 compare_fwd python3 bench/compare_torch_cuda.py --binary "$bin" --quick --rounds 2 \
    --min-time 0.2 --out "$logs/compare_cuda_fwd.json"
stage 80 compare_decode python3 bench/compare_torch_cuda_decode.py --binary "$bin" --rounds 2 \
    --min-time 0.2 --out "$logs/compare_cuda_decode.json"
stage 80 compare_decode_tc env FLASHATTN_CUDA_DECODE=tc python3 bench/compare_torch_cuda_decode.py \
    --binary "$bin" --rounds 2 --min-time 0.2 --out "$logs/compare_cuda_decode_tc.json"
stage 90 compare_bwd python3 bench/compare_torch_cuda.py --binary "$bin" --backward --quick --rounds 1 \
    --min-time 0.2 --out "$logs/compare_cuda_bwd.json"
stage 30 nvrtc_rate env FLASHATTN_CACHE_DIR=/tmp/flashattn-empty-cache "$bin" compile --filter fwd_bf16_d128

finish
