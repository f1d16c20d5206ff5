# The GPU test runs of bench/gpu/session.sh (side by side) and bench/gpu/run.sh (one after
# another), in one list: "log name|command", the command run from the repository root with the
# binaries bench/gpu/prepare.sh put in gpu-run/. Sourced, not run.
# The library's tests are modules of gpu-run/integration_tests_flashattn, the CLI's of
# gpu-run/cli_tests_flashattn-cli: each run's filters select exactly its GPU tests (the log names
# are those of the test binaries they once were).
GPU_TESTS=(
    "cuda_tests_flashattn|gpu-run/integration_tests_flashattn cuda::device:: --test-threads 4 --nocapture"
    "cuda_tests_flashattn-cli|gpu-run/cli_tests_flashattn-cli cuda:: --test-threads 2"
    "decode_tests_flashattn|gpu-run/integration_tests_flashattn decode::gpu:: --test-threads 1 --nocapture"
    # The same decode cases with every call on the CUDA-core split kernel (the tensor-core one is
    # the default where a call allows it).
    "decode_tests_flashattn_cc|env FLASHATTN_CUDA_DECODE=cuda-core gpu-run/integration_tests_flashattn decode::gpu:: --test-threads 1 --nocapture"
    "fp8_tests_flashattn|gpu-run/integration_tests_flashattn fp8::gpu:: --test-threads 1 --nocapture"
    "decode_tests_flashattn-cli|gpu-run/cli_tests_flashattn-cli decode::run_kvcache_on_cuda --test-threads 2"
    "fp8_tests_flashattn-cli|gpu-run/cli_tests_flashattn-cli fp8::run_fp8_kv_cache fp8::bench_decode_fp8_caches_on_cuda --test-threads 2"
)
