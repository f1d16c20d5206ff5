#!/usr/bin/env python3
"""Decoding with a KV cache: `flashattn bench --decode` against PyTorch's CPU SDPA, same shapes.

Usage (torch comes from bench/.venv, which `bench/compare_torch.py` sets up):

    bench/.venv/bin/python bench/compare_torch_decode.py                  # the decode benchmark shape
    bench/.venv/bin/python bench/compare_torch_decode.py --cache-len 4096,32768 --rounds 3
    bench/.venv/bin/python bench/compare_torch_decode.py --batch 64 --cache-len 512,2048   # serving

The shape (the decode benchmark shape, a long-context decoding step): batch 1, one new query token, 32 query heads over 8 kv heads, head_dim 128,
a cache of 32768 tokens, f32 and bf16, 2 threads. `--dtype e4m3,e5m2` times FP8 caches (q bf16)
against torch converting its float8 caches to bf16 per step before SDPA. `--batch B` decodes B sequences of the same
length at once (every sequence's cache full to `cache_len`, so torch's dense batch is the same
problem).

How it measures. For each dtype, `--rounds` rounds alternate one flashattn run and one torch run
(both see the same machine conditions); each run is a warm-up call and timed repeats until
`--min-time` seconds are spent (at least 3), reporting the median; a figure is the median over
rounds. flashattn runs as a separate process (`flashattn bench --decode --json --no-bandwidth`):
one step appends the new token to the cache (`cache_seqlens = cache_len - 1`) and attends all
`cache_len` keys. torch runs here, `torch.set_num_threads(--threads)`, on its layout: q
[B, 32, 1, 128], k/v [B, 8, cache_len, 128] with `enable_gqa=True`, and (a second variant) k/v
repeated to 32 heads beforehand, outside the timing, as code without GQA support does. Neither
appends inside torch's timing (its cache is a ready tensor), which favours torch by the cost of
one row copy.

Huge pages: flashattn's caches are allocated as `flashattn::memory::kv_cache_vec` allocates them,
advised for transparent huge pages (Linux), and torch runs with `THP_MEM_ALLOC_ENABLE=1`, which
makes its CPU allocator give the same advice for buffers of 2 MiB or more; `--no-huge-pages`
runs both in ordinary 4 KiB pages.

GB/s: the bytes of k and v one step must read, 2 * B * cache_len * heads_kv * head_dim * element
size (the same figure for every implementation; the repeated variant reads 4x that), over the
median time. The machine's memory bandwidth is measured in every round, by the flashattn run
itself around its timing (`bench --decode`'s `read_gbps_around`: the median of two sums of a
1 GiB buffer on all threads just before the timing and two just after), because on a shared
host it drifts by a third within minutes. "% read bw" is the median over rounds of each round's KV GB/s over that round's
read rate.

Output: a table and a JSON file (default bench/results/decode_<date>.json).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def flashattn_json(binary: Path, args: list[str]) -> list[dict]:
    res = subprocess.run([str(binary), *args], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: flashattn {' '.join(args)} failed: {res.stderr.strip()}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def time_torch(fn, min_time: float) -> float:
    """Median seconds of fn() after one warm-up; repeats until min_time is spent (>= 3)."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < 3 or (spent < min_time and len(times) < 1000):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "flashattn"))
    ap.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--cache-len", default="32768")
    ap.add_argument("--dtype", default="f32,bf16")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="caches in 4 KiB pages on both sides (flashattn --no-huge-pages; torch "
                         "without THP_MEM_ALLOC_ENABLE)")
    args = ap.parse_args()

    # Read by torch's CPU allocator at its first allocation, so set before the import.
    if args.no_huge_pages:
        os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
    else:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    binary = Path(args.binary).resolve()
    if not args.no_build and args.binary == str(ROOT / "target" / "release" / "flashattn"):
        log("cargo build --release -p flashattn-cli")
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "flashattn-cli"], cwd=ROOT, check=True)
    if not binary.exists():
        sys.exit(f"error: {binary} does not exist")

    common = [
        "--batch", str(args.batch), "--heads", str(args.heads), "--heads-kv", str(args.heads_kv),
        "--head-dim", str(args.head_dim), "--threads", str(args.threads),
        *(["--no-huge-pages"] if args.no_huge_pages else []),
    ]
    machine = None
    read_gbps: list[float] = []

    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
           "e4m3": torch.bfloat16, "e5m2": torch.bfloat16}
    elem = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1}
    # FP8 caches (flashattn's `bench --decode --dtype e4m3|e5m2`: q bf16, caches FP8 with a
    # power-of-two descale): torch keeps them as float8 tensors and, per step, converts them to
    # bf16 and multiplies by the factor before SDPA (its CPU SDPA takes no FP8), inside the timing.
    fp8 = {"e4m3": (torch.float8_e4m3fn, 2.0 ** -8), "e5m2": (torch.float8_e5m2, 2.0 ** -15)}
    results = []
    for dtype in args.dtype.split(","):
        for cap in [int(x) for x in args.cache_len.split(",")]:
            g = torch.Generator().manual_seed(0)
            q = torch.rand(args.batch, args.heads, 1, args.head_dim, generator=g, dtype=torch.float32).to(tdt[dtype]) * 2 - 1
            k = torch.rand(args.batch, args.heads_kv, cap, args.head_dim, generator=g).to(tdt[dtype]) * 2 - 1
            v = torch.rand(args.batch, args.heads_kv, cap, args.head_dim, generator=g).to(tdt[dtype]) * 2 - 1
            rep = args.heads // args.heads_kv
            k_rep = k.repeat_interleave(rep, dim=1).contiguous()
            v_rep = v.repeat_interleave(rep, dim=1).contiguous()
            samples = {"flashattn": [], "torch_sdpa_gqa": [], "torch_sdpa_repeated_kv": []}
            if dtype in fp8:
                f8, ds = fp8[dtype]
                k8, v8 = (k / ds).to(f8), (v / ds).to(f8)
                samples = {"flashattn": [], "torch_dequant_sdpa_gqa": []}
            round_bw: list[float] = []
            # Bytes of flashattn's caches the kernel backed with huge pages, per round (None where
            # it cannot tell): a round without them is slower for reasons of its own.
            round_huge: list = []
            with torch.inference_mode():
                for r in range(args.rounds):
                    lines = flashattn_json(binary, [
                        "bench", "--decode", "--json", "--dtype", dtype,
                        "--cache-len", str(cap), "--min-time", str(args.min_time), *common])
                    machine = lines[0]
                    # The read rate sampled just before and after this run's measurement.
                    round_bw.append(lines[1]["read_gbps_around"])
                    round_huge.append(lines[1].get("huge_page_bytes"))
                    samples["flashattn"].append(lines[1]["median_ms"] / 1e3)
                    if dtype in fp8:
                        samples["torch_dequant_sdpa_gqa"].append(time_torch(
                            lambda: F.scaled_dot_product_attention(
                                q, k8.to(torch.bfloat16) * ds, v8.to(torch.bfloat16) * ds,
                                enable_gqa=True), args.min_time))
                    else:
                        samples["torch_sdpa_gqa"].append(time_torch(
                            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), args.min_time))
                        samples["torch_sdpa_repeated_kv"].append(time_torch(
                            lambda: F.scaled_dot_product_attention(q, k_rep, v_rep), args.min_time))
                    log(f"{dtype} cache {cap} round {r + 1}/{args.rounds}: read {round_bw[-1]:.1f} GB/s, "
                        + ", ".join(f"{n} {s[-1] * 1e3:.2f} ms" for n, s in samples.items()))
            read_gbps += round_bw
            kv_bytes = 2.0 * args.batch * cap * args.heads_kv * args.head_dim * elem[dtype]
            for name, s in samples.items():
                med = statistics.median(s)
                results.append({
                    "impl": name, "dtype": dtype, "cache_len": cap, "batch": args.batch, "seqlen_q": 1,
                    "heads": args.heads, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
                    "threads": args.threads, "median_ms": med * 1e3,
                    "samples_ms": [x * 1e3 for x in s], "kv_bytes": kv_bytes,
                    "gbps": kv_bytes / med / 1e9,
                    "read_gbps_rounds": round_bw,
                    **({"huge_page_bytes_rounds": round_huge} if name == "flashattn" else {}),
                    "read_bandwidth_fraction": statistics.median(
                        kv_bytes / t / 1e9 / b for t, b in zip(s, round_bw)),
                })

    print(f"memory bandwidth: read {min(read_gbps):.1f}-{max(read_gbps):.1f} GB/s over the rounds "
          f"(median {statistics.median(read_gbps):.1f}; 1 GiB, {args.threads} threads)")
    print(f"batch {args.batch}, heads {args.heads} (kv {args.heads_kv}), head_dim {args.head_dim}, one new token")
    print(f"{'dtype':<6}{'cache':>7}  {'impl':<24}{'median ms':>10}{'KV GB/s':>9}{'% read bw':>10}{'torch/flash':>12}")
    for r in results:
        flash = next(x for x in results if x["impl"] == "flashattn" and x["dtype"] == r["dtype"]
                     and x["cache_len"] == r["cache_len"])
        ratio = r["median_ms"] / flash["median_ms"]
        print(f"{r['dtype']:<6}{r['cache_len']:>7}  {r['impl']:<24}{r['median_ms']:>10.3f}{r['gbps']:>9.2f}"
              f"{100 * r['read_bandwidth_fraction']:>9.1f}%{ratio:>11.2f}x")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"decode_{_dt.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "format": "flashattn-decode-compare/1",
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "machine": {**machine, "read_gbps_rounds": read_gbps, "torch_version": torch.__version__,
                    "loadavg_end": os.getloadavg()},
        "settings": {"rounds": args.rounds, "min_time": args.min_time,
                     "huge_pages": not args.no_huge_pages},
        "results": results,
    }, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
