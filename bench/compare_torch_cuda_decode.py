#!/usr/bin/env python3
"""flashattn's CUDA decode step against PyTorch's scaled_dot_product_attention on the same GPU, in
one run: interleaved rounds, CUDA-event timing, medians.

The decode benchmark shape: batch 1, one new token, 32 query heads over 8 kv heads, head_dim 128, caches of
4k-32k tokens (and a batch of 64 sequences x 2k), f32 and bf16. flashattn's step appends the token
and attends the whole cache (`flashattn bench --decode --device cuda`); PyTorch's attends the same
cache with `enable_gqa=True` (the caches laid out [batch, heads_kv, tokens, d], its layout), with
no append. KV GB/s = bytes of k and v one step reads over the median time; "of copy" is that over
the GPU's device-to-device copy rate (read + write) measured by the flashattn run.

`--dtype e4m3,e5m2` times FP8 caches (flashattn: `bench --decode --device cuda --dtype e4m3`, q
bf16, one power-of-two factor): PyTorch's SDPA takes no float8 tensors, so its route keeps the
caches as float8 and converts them to bf16 times the factor every step before SDPA.

    python3 bench/compare_torch_cuda_decode.py --binary gpu-run/flashattn [--dtype bf16,f32,e4m3]
        [--out results.json]
"""
import argparse
import datetime
import json
import statistics
import sys

from compare_torch_cuda import event_median_ms, run_json

HEADS, HEADS_KV, D = 32, 8, 128
ELEM = {"f32": 4, "bf16": 2, "e4m3": 1, "e5m2": 1}


def _fp8():
    import torch
    # The factor flashattn's bench uses (bench::fp8_descale).
    return {"e4m3": (torch.float8_e4m3fn, 2.0 ** -8), "e5m2": (torch.float8_e5m2, 2.0 ** -15)}


FP8 = {}


def torch_ms(b, n, dtype, min_time):
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(n)
    if dtype in FP8:
        f8, scale = FP8[dtype]
        q = torch.randn(b, HEADS, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        fmax = torch.finfo(f8).max  # torch's float8 casts do not saturate
        k8, v8 = (torch.randn(b, HEADS_KV, n, D, device="cuda", generator=g).div(scale)
                  .clamp(-fmax, fmax).to(f8) for _ in range(2))

        def step():
            k = k8.to(torch.bfloat16) * scale
            v = v8.to(torch.bfloat16) * scale
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return event_median_ms(step, min_time)
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    q = torch.randn(b, HEADS, 1, D, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, HEADS_KV, n, D, device="cuda", dtype=dt, generator=g)
    v = torch.randn(b, HEADS_KV, n, D, device="cuda", dtype=dt, generator=g)
    return event_median_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                           min_time)


def flash(binary, b, n, dtype, min_time):
    return run_json([binary, "bench", "--decode", "--device", "cuda", "--dtype", dtype,
                     "--batch", str(b), "--heads", str(HEADS), "--heads-kv", str(HEADS_KV),
                     "--head-dim", str(D), "--cache-len", str(n), "--json",
                     "--min-time", str(min_time)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="gpu-run/flashattn")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--dtype", default="bf16,f32",
                    help="comma-separated: bf16, f32, e4m3, e5m2 (FP8 caches)")
    args = ap.parse_args()

    import torch
    FP8.update(_fp8())
    shapes = [(1, 4096), (1, 16384), (1, 32768), (64, 2048)]
    rows, machine = [], None
    for dtype in args.dtype.split(","):
        for b, n in shapes:
            t_ms, f_ms, fm = [], [], None
            for _ in range(args.rounds):
                t_ms.append(torch_ms(b, n, dtype, args.min_time))
                machine, fm = flash(args.binary, b, n, dtype, args.min_time)
                f_ms.append(fm["median_ms"])
            t, f = statistics.median(t_ms), statistics.median(f_ms)
            kv = 2.0 * b * n * HEADS_KV * D * ELEM[dtype]
            row = dict(dtype=dtype, batch=b, cache_len=n, torch_ms=t, flashattn_ms=f,
                       speedup=t / f, flashattn_gbps=kv / f / 1e6, torch_gbps=kv / t / 1e6,
                       of_copy=kv / f / 1e6 / machine["copy_gbps"],
                       flashattn_max_abs_err=fm["max_abs_err"], kernel=fm["kernel"],
                       torch_round_ms=t_ms, flashattn_round_ms=f_ms)
            rows.append(row)
            print(f"{dtype} b={b:2} cache={n:6}: torch {t:8.4f} ms {row['torch_gbps']:6.0f} GB/s | "
                  f"flashattn {f:8.4f} ms {row['flashattn_gbps']:6.0f} GB/s "
                  f"({100 * row['of_copy']:.0f}% of copy) | x{row['speedup']:.2f} | "
                  f"err {fm['max_abs_err']:.1e} | {fm['kernel']}", flush=True)
    print(f"device {machine['device']} ({machine['arch']}), copy {machine['copy_gbps']:.0f} GB/s, "
          f"torch {torch.__version__}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           machine=machine, torch=torch.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
