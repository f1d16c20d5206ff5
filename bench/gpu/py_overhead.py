"""Where a call of flashattn's Python package on CUDA tensors spends its time, beside SDPA: host
time per call (100 calls queued without synchronising), device time per call (CUDA events around
100 back-to-back calls), the kernels torch's profiler sees, and the Python functions cProfile
sees. Needs FLASHATTN_PY_CUDA=1 (set here) and a CUDA GPU.

    python3 bench/gpu/py_overhead.py
"""
import cProfile
import os
import pstats
import time

os.environ.setdefault("FLASHATTN_PY_CUDA", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashattn  # noqa: E402


def per_call(fn, n=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return host * 1e3, start.elapsed_time(end) / n


def main():
    for b, n, h, d in [(1, 2048, 16, 64), (4, 4096, 16, 128)]:
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fa = lambda: flashattn.flash_attn_func(q, k, v)  # noqa: E731
        sd = lambda: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
        with torch.no_grad():
            for name, fn in (("flashattn", fa), ("sdpa", sd)):
                host, dev = per_call(fn)
                print(f"b={b} n={n} h={h} d={d} {name:9}: host {host:.3f} ms/call queued, "
                      f"device {dev:.3f} ms/call back to back", flush=True)
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU,
                                torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fa()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                fa()
            torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("cumulative").print_stats(12)


if __name__ == "__main__":
    main()
