"""``python -m flashattn.bench``: flashattn against PyTorch's scaled_dot_product_attention.

Both run on the same tensors (CPU, or CUDA with ``--device cuda``), in interleaved rounds (flashattn, SDPA, flashattn, ...); each
round's time is the median of a few calls, and the reported time is the median over rounds.
Ratio = SDPA time / flashattn time (above 1: flashattn is faster). FLOP model: forward
4·B·H·Sq·Sk·d (halved for causal with Sq = Sk), forward+backward 3.5× that.

    python -m flashattn.bench                         # a few default shapes, f32 and bf16
    python -m flashattn.bench --seqlen 2048 --head-dim 128 --dtype bf16 --causal
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import flashattn

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _time(fn, reps: int, sync=lambda: None) -> float:
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _flops(b, h, n, d, causal, backward):
    f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def bench_shape(batch, heads, seqlen, head_dim, dtype, causal, backward, rounds, reps,
                device="cpu"):
    g = torch.Generator().manual_seed(0)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    dout = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # SDPA takes [batch, heads, seqlen, d]: the same memory, transposed views.
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))

    def run_fa():
        if backward:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            flashattn.flash_attn_func(qq, kk, vv, causal=causal).backward(dout)
        else:
            with torch.no_grad():
                flashattn.flash_attn_func(q, k, v, causal=causal)

    def run_sdpa():
        if backward:
            qq, kk, vv = (t.detach().requires_grad_() for t in (qs, ks, vs))
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).backward(
                dout.transpose(1, 2))
        else:
            with torch.no_grad():
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

    run_fa(), run_sdpa()  # warm-up
    fa, sd = [], []
    for _ in range(rounds):
        fa.append(_time(run_fa, reps, sync))
        sd.append(_time(run_sdpa, reps, sync))
    t_fa, t_sd = statistics.median(fa), statistics.median(sd)
    flops = _flops(batch, heads, seqlen, head_dim, causal, backward)
    return {
        "pass": "fwd+bwd" if backward else "fwd",
        "batch": batch, "heads": heads, "seqlen": seqlen, "head_dim": head_dim,
        "dtype": str(dtype).removeprefix("torch."), "causal": causal, "device": device,
        "flashattn_ms": t_fa * 1e3, "sdpa_ms": t_sd * 1e3,
        "flashattn_gflops": flops / t_fa / 1e9, "sdpa_gflops": flops / t_sd / 1e9,
        "ratio": t_sd / t_fa,
    }


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, nargs="*", default=[1024, 2048])
    p.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    p.add_argument("--dtype", nargs="*", default=["f32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--causal", action="store_true", help="causal only (default: both)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: torch CUDA tensors through flashattn's CUDA backend")
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    info = {
        "flashattn_isa": flashattn.isa(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": a.device,
    }
    if a.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    where = info.get("gpu") or f"CPU, ISA {info['flashattn_isa']}, {info['threads']} threads"
    print(f"flashattn on {where}, torch {info['torch']}; ratio = SDPA ms / flashattn ms")
    print(f"{'pass':8} {'dtype':9} {'N':>5} {'d':>4} {'causal':6} {'flashattn ms':>12} "
          f"{'SDPA ms':>9} {'GFLOP/s':>8} {'ratio':>6}")
    rows = []
    causals = [True] if a.causal else [False, True]
    passes = [False] if a.no_backward else [False, True]
    for backward in passes:
        for dt in a.dtype:
            for n in a.seqlen:
                for d in a.head_dim:
                    for c in causals:
                        r = bench_shape(a.batch, a.heads, n, d, DTYPES[dt], c, backward,
                                        a.rounds, a.reps, a.device)
                        rows.append(r)
                        print(f"{r['pass']:8} {r['dtype']:9} {n:>5} {d:>4} {str(c):6} "
                              f"{r['flashattn_ms']:>12.2f} {r['sdpa_ms']:>9.2f} "
                              f"{r['flashattn_gflops']:>8.1f} {r['ratio']:>6.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
