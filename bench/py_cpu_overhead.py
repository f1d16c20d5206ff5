"""Per-call host cost of flashattn's Python entry point on the CPU against SDPA's, on a problem so
small (1 x 1 x 1 x 8) that the attention itself costs nothing: what a decode step pays per layer.

    bench/.venv/bin/python bench/py_cpu_overhead.py [--threads N]
"""
import argparse
import time

import torch
import torch.nn.functional as F

from flashattn import flash_attn_func


def per_call_us(f, n=3000, repeats=5):
    for _ in range(200):
        f()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q = torch.randn(1, 1, 1, 8)
    qt = q.transpose(1, 2)
    fa = per_call_us(lambda: flash_attn_func(q, q, q))
    op = per_call_us(lambda: torch.ops.flashattn.fwd(q, q, q, None, None, 0.0, 0.35, False, -1, -1,
                                                     0.0, None, None))
    sdpa = per_call_us(lambda: F.scaled_dot_product_attention(qt, qt, qt))
    print(f"threads {args.threads}: flash_attn_func {fa:.1f} us/call, the custom op alone "
          f"{op:.1f}, SDPA {sdpa:.1f} (best of 5 loops of 3000 calls)")


if __name__ == "__main__":
    main()
