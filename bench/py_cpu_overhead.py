"""Per-call host cost of flashattn's Python entry points on the CPU against SDPA's: a problem so
small (1 x 1 x 1 x 8) that the attention itself costs nothing, and one decode step
(flash_attn_with_kvcache: one query, one new key appended to a 4k cache, one head of 64 by
default): what a decode step pays per layer.

    bench/.venv/bin/python bench/py_cpu_overhead.py [--threads N] [--heads H] [--head-dim D]
        [--cache N] [--parts]

--parts also times the pieces of one tiny call (the checks, torch.empty of out, the option dict,
the views, the extension call alone) to show where what remains goes.
"""
import argparse
import time

import torch
import torch.nn.functional as F

from flashattn import flash_attn_func, flash_attn_with_kvcache


def per_call_us(f, n=300, repeats=40):
    """Best of `repeats` loops of `n` calls: short loops, so that on a shared machine some run
    undisturbed."""
    for _ in range(200):
        f()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def tiny(threads):
    q = torch.randn(1, 1, 1, 8)
    qt = q.transpose(1, 2)
    fa = per_call_us(lambda: flash_attn_func(q, q, q))
    op = per_call_us(lambda: torch.ops.flashattn.fwd(q, q, q, None, None, 0.0, 0.35, False, -1, -1,
                                                     0.0, None, None))
    sdpa = per_call_us(lambda: F.scaled_dot_product_attention(qt, qt, qt))
    print(f"threads {threads}, tiny 1x1x1x8: flash_attn_func {fa:.1f} us/call, the custom op "
          f"alone {op:.1f}, SDPA {sdpa:.1f} ({fa / sdpa:.1f}x SDPA)")


def decode(threads, heads, d, cache):
    q = torch.randn(1, 1, heads, d)
    k_cache = torch.randn(1, cache, heads, d)
    v_cache = torch.randn(1, cache, heads, d)
    k_new, v_new = torch.randn(1, 1, heads, d), torch.randn(1, 1, heads, d)
    # The new key goes to the last slot every call: the cache holds `cache` keys after it.
    seqlens = torch.full((1,), cache - 1, dtype=torch.int32)
    n = 100 if cache * heads * d <= 1 << 20 else 20
    fa = per_call_us(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                     cache_seqlens=seqlens), n=n)
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    sdpa = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt), n=n)
    print(f"threads {threads}, decode (1 query, {heads} head(s) of {d}, cache {cache}, f32): "
          f"flash_attn_with_kvcache {fa:.1f} us/call, SDPA over the same cache {sdpa:.1f} "
          f"({fa / sdpa:.2f}x SDPA)")


def parts():
    """The pieces of one tiny `flash_attn_func` call (the eager path that skips the dispatcher),
    each timed alone."""
    from flashattn import _ops

    q = torch.randn(1, 1, 1, 8)
    out = torch.empty_like(q)
    views = [_ops._view(n, t) for n, t in (("q", q), ("k", q), ("v", q), ("out", out))]
    opts = _ops._opts(0.35, False, -1, -1, 0.0, None, None)
    rows = {
        "the checks (_direct)": lambda: _ops._direct(q, q, q, None, None, None, None),
        "torch.empty of out": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "option dict (_opts)": lambda: _ops._opts(0.35, False, -1, -1, 0.0, None, None),
        "four views (_view)": lambda: [_ops._view(n, t) for n, t in (
            ("q", q), ("k", q), ("v", q), ("out", out))],
        "extension call (_ext.fwd, no lse)": lambda: _ops._ext.fwd(*views, None, opts),
        "flash_attn_func": lambda: flash_attn_func(q, q, q),
        "the op (torch.ops.flashattn.fwd)": lambda: torch.ops.flashattn.fwd(
            q, q, q, None, None, 0.0, 0.35, False, -1, -1, 0.0, None, None),
    }
    for name, f in rows.items():
        print(f"  {name:34s} {per_call_us(f):7.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, default=1, help="decode: heads (of q and the cache)")
    ap.add_argument("--head-dim", type=int, default=64, help="decode: head dimension")
    ap.add_argument("--cache", type=int, default=4096, help="decode: keys in the cache")
    ap.add_argument("--parts", action="store_true", help="time the pieces of a tiny call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tiny(args.threads)
    decode(args.threads, args.heads, args.head_dim, args.cache)
    if args.parts:
        parts()
    print("(per call: the best of 40 loops of 300 calls, 100 for the decode)")


if __name__ == "__main__":
    main()
