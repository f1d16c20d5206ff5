#!/usr/bin/env bash
# Builds what a GPU session carries to the device machine (which has no Rust toolchain) into
# gpu-run/ (git-ignored): the release `flashattn` binary, the Python wheel and the two test binaries, stripped so
# the folder stays far below the 64 MiB carry limit. Then, on the device machine:
#
#   bash bench/gpu/session.sh 500  # one call: the GPU tests, then flashattn vs PyTorch SDPA
#   bash bench/gpu/run.sh STAGE    # or stage by stage
#
# `prepare.sh --cache` also compiles every kernel variant for sm_90a (H100/H200) with NVRTC into a
# fresh cache and packs it as gpu-run/cache_sm90a.tar.xz (~15 MB: xz finds what the 2444 cubins
# share, where gzip left 41 MB of 146; ~20 min on 2 cores; needs NVRTC
# 13.0, e.g. FLASHATTN_NVRTC=target/nvrtc/nvidia/cu13/lib as .ci/run installs it). session.sh
# unpacks it there, so the lease loads kernels instead of compiling them.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf gpu-run && mkdir -p gpu-run
cargo build --release -p flashattn-cli
cp target/release/flashattn gpu-run/
# The test executables of the library and the CLI (no debug info: smaller to carry): each crate's
# one integration-test binary, `integration` (its modules `cuda::device`, `decode::gpu` and
# `fp8::gpu` run the CUDA forward, backward, decode and FP8 paths) and `cli` (its modules `cuda`,
# `decode` and `fp8` run `--device cuda`); tests.sh selects the GPU tests in them by filter.
CARGO_PROFILE_DEV_DEBUG=0 cargo test --workspace --test integration --test cli --no-run \
    --message-format=json | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("integration", "cli"):
        pkg = m["package_id"].split("#")[0].rstrip("/").split("/")[-1]
        name = m["target"]["name"] + "_tests_" + pkg
        shutil.copy(m["executable"], "gpu-run/" + name)
        print("copied", name)
'
strip gpu-run/* 2>/dev/null || true
# The Python package's wheel (abi3: the device machine's Python 3.12 installs it), built with
# maturin from bench/.venv (scripts/test installs it there).
if [ -x bench/.venv/bin/maturin ]; then
    bench/.venv/bin/maturin build --release --strip -m flashattn-py/Cargo.toml --out gpu-run
else
    echo "no bench/.venv/bin/maturin: the wheel is not carried (run scripts/test --python first)"
fi
du -sh gpu-run
if [ "${1:-}" = --cache ]; then
    cache=$(mktemp -d)
    FLASHATTN_CACHE_DIR=$cache target/release/flashattn compile --arch sm_90a
    tar cJf gpu-run/cache_sm90a.tar.xz -C "$cache" .
    rm -rf "$cache"
    du -sh gpu-run
fi
