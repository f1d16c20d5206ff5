#!/usr/bin/env python3
"""flashattn's CUDA forward (or forward + backward, --backward) against PyTorch's
scaled_dot_product_attention (flash backend) on the same GPU, in one run: interleaved rounds,
CUDA-event timing, medians, one FLOP model.

Shapes: bf16, batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 / d),
d = 64 and 128, seqlen 512 .. 16k, causal and not. FLOPs: 4 * batch * heads * d * (visible
query-key pairs), the pairs halved (s(s+1)/2) for causal, as flashattn::flops::forward; forward +
backward counts 3.5x that (the backward 2.5x).

Needs: a CUDA GPU, PyTorch with CUDA, and a release build of the `flashattn` binary (built
elsewhere: `cargo build --release -p flashattn-cli`, copied next to this script or named by
--binary). flashattn finds NVRTC by itself (PyTorch's wheel ships one); FLASHATTN_NVRTC overrides.

`--dtype e4m3|e5m2` times flashattn's FP8 forward (`bench --device cuda --dtype e4m3`: q, k, v in
FP8 with one power-of-two factor each, out bf16). PyTorch's SDPA takes no float8 tensors, so its
route keeps q, k, v as float8 and converts them to bf16 times the factor before the bf16 SDPA
(flash backend); the conversion is timed with it. Forward only.

    python3 bench/compare_torch_cuda.py --binary gpu-run/flashattn [--quick] [--out results.json]

`--cudnn` times SDPA's cuDNN backend too, in the same rounds.
`--variant LABEL=BINARY[,ENV=VALUE...]` (repeatable) times further flashattn builds or settings in
the same rounds, call after call with the main one (an A/B of a kernel change on one warm GPU);
their medians and their time over the main binary's go into the table and the JSON.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time


def pairs(s, causal):
    return s * (s + 1) // 2 if causal else s * s


def event_median_ms(fn, min_time):
    """Median CUDA-event time of fn() (ms) after 5 warm-up calls, for min_time s and >= 10 calls."""
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times, t0 = [], time.time()
    while len(times) < 10 or (time.time() - t0 < min_time and len(times) < 5000):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def torch_ms(b, h, s, d, causal, dtype, min_time, backward=False, backend="flash"):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(s * 31 + d)
    if dtype in ("e4m3", "e5m2"):
        # The factor flashattn's bench uses (bench::fp8_descale); torch's float8 casts do not
        # saturate, hence the clamp.
        f8, scale = {"e4m3": (torch.float8_e4m3fn, 2.0 ** -8),
                     "e5m2": (torch.float8_e5m2, 2.0 ** -15)}[dtype]
        fmax = torch.finfo(f8).max
        q8, k8, v8 = (torch.randn(b, h, s, d, device="cuda", generator=g).div(scale)
                      .clamp(-fmax, fmax).to(f8) for _ in range(3))

        def fp8_step():
            q, k, v = (x.to(torch.bfloat16) * scale for x in (q8, k8, v8))
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return event_median_ms(fp8_step, min_time)
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt, generator=g,
                           requires_grad=backward) for _ in range(3))
    dout = torch.randn(b, h, s, d, device="cuda", dtype=dt, generator=g)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if backward:
            torch.autograd.grad(out, (q, k, v), dout)

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([chosen]):
        return event_median_ms(step, min_time)


def run_json(cmd, env=None):
    """Runs a `flashattn ... --json` command: its machine line and first measurement line."""
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"flashattn failed: {' '.join(cmd)}\n{r.stderr}")
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
    machine = next(l for l in lines if l["kind"] == "machine")
    m = next(l for l in lines if l["kind"] == "measurement")
    return machine, m


def flash(binary, b, h, s, d, causal, dtype, min_time, backward=False, env=None):
    cmd = [binary, "bench", "--device", "cuda", "--dtype", dtype, "--batch", str(b),
           "--heads", str(h), "--head-dim", str(d), "--seqlen", str(s), "--json",
           "--min-time", str(min_time)] + (["--causal"] if causal else []) \
        + (["--backward"] if backward else [])
    return run_json(cmd, env)


def parse_variant(text):
    """LABEL=BINARY[,ENV=VALUE...] -> (label, binary, environment)."""
    label, _, rest = text.partition("=")
    binary, *settings = rest.split(",")
    if not label or not binary or any("=" not in x for x in settings):
        raise SystemExit(f"--variant {text!r}: expected LABEL=BINARY[,ENV=VALUE...]")
    return label, binary, dict(os.environ, **dict(x.split("=", 1) for x in settings))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "flashattn"))
    ap.add_argument("--quick", action="store_true", help="seqlen 512, 4096 and 16384 only, d=128")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "e4m3", "e5m2"])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL=BINARY[,ENV=VALUE...]: another build or setting, timed alongside")
    ap.add_argument("--seqlens", help="comma-separated sequence lengths (overrides --quick's)")
    ap.add_argument("--dims", help="comma-separated head dims (overrides --quick's)")
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--cudnn", action="store_true",
                    help="also time SDPA's cuDNN backend in the same rounds (16-bit dtypes)")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    if args.backward and args.dtype in ("e4m3", "e5m2"):
        ap.error("FP8 has a forward pass only")

    import torch
    seqlens = [512, 4096, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    if args.seqlens:
        seqlens = [int(x) for x in args.seqlens.split(",")]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    dims = [128] if args.quick else [64, 128]
    if args.dims:
        dims = [int(x) for x in args.dims.split(",")]
    rows, machine = [], None
    for d in dims:
        h = args.hidden // d
        for causal in causals:
            for s in seqlens:
                b = max(1, args.tokens // s)
                flops = 4.0 * b * h * d * pairs(s, causal) * (3.5 if args.backward else 1.0)
                t_ms, f_ms, c_ms, fm = [], [], [], None
                v_ms = {label: [] for label, _, _ in variants}
                for _ in range(args.rounds):
                    t_ms.append(torch_ms(b, h, s, d, causal, args.dtype, args.min_time,
                                         args.backward))
                    if args.cudnn:
                        c_ms.append(torch_ms(b, h, s, d, causal, args.dtype, args.min_time,
                                             args.backward, backend="cudnn"))
                    machine, fm_round = flash(args.binary, b, h, s, d, causal, args.dtype,
                                              args.min_time, args.backward)
                    fm = fm or fm_round  # the first round's kernel origin (compile or disk)
                    f_ms.append(fm_round["median_ms"])
                    for label, binary, env in variants:
                        # A variant that fails (an experimental kernel) is recorded as missing,
                        # not allowed to end the comparison.
                        try:
                            _, vm = flash(binary, b, h, s, d, causal, args.dtype, args.min_time,
                                          args.backward, env)
                            v_ms[label].append(vm["median_ms"])
                        except SystemExit as e:
                            print(f"variant {label} failed: {str(e)[-400:]}", flush=True)
                t, f = statistics.median(t_ms), statistics.median(f_ms)
                row = dict(pass_="fwd+bwd" if args.backward else "fwd", dtype=args.dtype, batch=b, heads=h, seqlen=s, head_dim=d, causal=causal,
                           torch_ms=t, flashattn_ms=f, torch_tflops=flops / t / 1e9,
                           flashattn_tflops=flops / f / 1e9, speedup=t / f,
                           flashattn_max_abs_err=fm["max_abs_err"], kernel=fm["kernel"],
                           first_use=fm["kernel_origin"], first_use_ms=fm["prepare_ms"],
                           torch_round_ms=t_ms, flashattn_round_ms=f_ms,
                           cudnn_ms=statistics.median(c_ms) if c_ms else None,
                           cudnn_round_ms=c_ms,
                           variants={label: dict(ms=statistics.median(ms), round_ms=ms,
                                                 time_over_main=statistics.median(ms) / f,
                                                 tflops=flops / statistics.median(ms) / 1e9)
                                     for label, ms in v_ms.items() if ms})
                rows.append(row)
                print(f"d={d:3} causal={causal!s:5} s={s:5} b={b:2} h={h:2}: torch {t:8.3f} ms "
                      f"{row['torch_tflops']:6.1f} TF/s | flashattn {f:8.3f} ms "
                      f"{row['flashattn_tflops']:6.1f} TF/s | x{row['speedup']:.2f} | "
                      f"err {fm['max_abs_err']:.1e} | {fm['kernel_origin']} {fm['prepare_ms']:.0f} ms"
                      + (f" | cudnn {row['cudnn_ms']:.3f} ms "
                         f"{flops / row['cudnn_ms'] / 1e9:6.1f} TF/s x{row['cudnn_ms'] / f:.2f}"
                         if c_ms else "")
                      + "".join(f" | {label} {v['ms']:.3f} ms {v['tflops']:.1f} TF/s "
                                f"({v['time_over_main']:.2f})"
                                for label, v in row["variants"].items()),
                      flush=True)
    speedups = [r["speedup"] for r in rows]
    geo = statistics.geometric_mean(speedups)
    print(f"device {machine['device']} ({machine['arch']}), torch {torch.__version__}; "
          f"flashattn/torch speed geomean x{geo:.2f}, min x{min(speedups):.2f}, max x{max(speedups):.2f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           machine=machine, torch=torch.__version__, rows=rows,
                           geomean_speedup=geo), fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
