#!/usr/bin/env python3
"""flashattn against PyTorch's CPU `scaled_dot_product_attention` (and naive attention).

Usage (from anywhere; plain `python3`, the script sets up its own environment):

    python3 bench/compare_torch.py --quick                       # smoke run, ~1 min after setup
    python3 bench/compare_torch.py                               # the default grid, forward
    python3 bench/compare_torch.py --backward --dtype bf16 --head-dim 128 --seqlen 1024,2048
    python3 bench/compare_torch.py --out bench/results/x.json --svg docs/perf_cpu.svg

Defaults: 2 threads, batch 1, 16 heads, head_dim 64 and 128, sequence lengths
512..8192, f32 and bf16, non-causal and causal, forward. `--backward` times forward+backward
instead, `--both-passes` both (`--backward-max-seqlen N` limits forward+backward to lengths up
to N: it costs 3.5x the forward's FLOPs). Restrict with `--dtype`, `--head-dim`, `--seqlen` (comma lists),
`--causal-only` / `--no-causal`. `--dtype e4m3` or `e5m2` times FP8 inputs (forward only): torch's
CPU SDPA does not take FP8 tensors, so its side is "dequantise to bf16, then SDPA", timed together.

How it measures. For each shape, `--rounds` rounds alternate a flashattn run and a torch run, so
both see the same machine conditions; each run is a warm-up call and then timed repeats until
`--min-time` seconds are spent (at least 3, or 1 when the warm-up alone took that long: the rule
of `flashattn bench`), and reports its median; a shape's figure is the median over rounds.
flashattn runs as a separate process, `target/release/flashattn bench --json --no-peak
--no-naive ...` (built with `cargo build --release -p flashattn-cli` unless `--no-build`), on its
own layout [batch, seqlen, heads, head_dim]; torch runs in this process on its layout
[batch, heads, seqlen, head_dim], with `torch.set_num_threads(--threads)`. Neither transposes
anything inside the timing. Naive attention (`flashattn bench` without `--no-naive`: matmul,
softmax, matmul, materialising the N x N scores) is measured once per shape, in the first round's
flashattn process, up to `--naive-max-seqlen` (default 4096; its scores need 2 GiB at N=4096 with
16 heads). The machine's peak FLOP rates come from `flashattn peak --json` once at the start.

FLOP model (the same for every implementation, the one of `flashattn::flops`): forward
4 * batch * heads * head_dim * (visible query-key pairs): N^2 pairs, or N(N+1)/2 under the causal
mask; forward+backward 3.5x the forward. Torch's backward is timed as forward + `out.backward(dout)`
on inputs with requires_grad.

Output: a table (flashattn/torch ratio per shape), and a JSON file (default
bench/results/compare_<date>.json; `--quick` writes quick_<date>.json) of this form:

    {"format": "flashattn-compare/1", "created": ..., "argv": [...],
     "machine": {"threads", "isa", "peak_f32_gflops", "peak_bf16_gflops", "cpu_model", "nproc",
                 "loadavg_start", "loadavg_end", "torch_version", "torch_config", ...},
     "settings": {"rounds", "min_time", "flop_model", "layouts"},
     "results": [{"impl": "flashattn" | "torch_sdpa" | "naive", "dtype", "batch", "heads",
                  "seqlen_q", "seqlen_k", "head_dim", "causal", "pass": "fwd" | "fwd+bwd",
                  "threads", "flops", "median_ms", "gflops", "samples_ms": [per-round medians],
                  "peak_fraction", "max_abs_err", "layout", "loadavg", "others_cores",
                  "attempts"}, ...],
     "ratios": [{"dtype", "head_dim", "causal", "pass", "seqlen", "flashattn_gflops",
                 "torch_gflops", "naive_gflops", "flashattn_over_torch"}, ...]}

Interference: the other processes' CPU use during each shape (the machine's busy CPU time from
/proc/stat minus this process's and its children's) is recorded as "others_cores" and shown in
the table's "others" column; a shape during which it exceeded `--max-others` (0.1 cores) is
measured again after waiting for a quiet machine (`--retries` 2, `--wait-quiet` 300 s), keeping the
least disturbed attempt ("attempts" in the JSON). The summary lists shapes still disturbed.

`flashattn plot FILE.json OUT.svg` draws it (`--svg OUT.svg` here does that at the end). The file is
rewritten after every shape, so an interrupted run keeps what it measured.

Setting up torch. PyPI's only Linux x86-64 torch wheels are CUDA builds (2.15.0+cu132) and the
CPU-only index (download.pytorch.org) is not reachable from this project's machines. `pip install
--no-deps torch` alone does not import (libtorch links libcudart.so.13, libcublas.so.13, ...), so
the first run creates bench/.venv and installs torch==2.15.0 with --no-deps, then the dependencies
torch's metadata declares for this platform, except the GPU-only Python packages `triton` and
`cuda-bindings`, plus numpy (pip then warns that those two are missing; torch imports and runs
on the CPU without them): the NVIDIA runtime libraries are installed (about 3 GB; loaded at import
but never used, no GPU needed), and bench/.venv takes 4.4 GB instead of the 5.3 GB of a plain
`pip install torch`. Measured on the 2-core build machine: this setup took 110 s with pip's cache
disabled (PIP_NO_CACHE_DIR=1, all downloads; `--setup-only` does just that step), while a plain
`pip install torch==2.15.0` into a fresh venv took 120 s. Delete bench/.venv to reinstall.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = ROOT / "bench" / ".venv"
TORCH_VERSION = "2.15.0"
# Python packages torch declares that only matter on a GPU; leaving them out saves ~1 GB.
SKIP_DEPS = {"triton", "cuda-bindings"}
FLOP_MODEL = (
    "forward 4*batch*heads*head_dim*(visible query-key pairs: N^2, or N(N+1)/2 causal); "
    "fwd+bwd 3.5x forward"
)
MAX_REPS = 1000


# ---- environment ---------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_checked(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, **kw)
    if res.returncode != 0:
        sys.exit(f"error: {what} failed (exit {res.returncode}): {' '.join(map(str, cmd))}")
    return res


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def torch_works(py: Path) -> bool:
    probe = (
        "import torch, torch.nn.functional as F\n"
        "q = torch.rand(1, 2, 8, 4)\n"
        "assert F.scaled_dot_product_attention(q, q, q, is_causal=True).shape == q.shape\n"
    )
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    return res.returncode == 0


def install_torch(venv: Path, version: str) -> None:
    """Creates `venv` and installs a working CPU torch into it (see the module docstring)."""
    t0 = time.monotonic()
    py = venv_python(venv)
    if not py.exists():
        log(f"creating {venv}")
        run_checked([sys.executable, "-m", "venv", str(venv)], "creating the virtualenv")
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
    log(f"installing torch=={version} (no dependencies yet)")
    run_checked(pip + ["--no-deps", f"torch=={version}"], "pip install torch")
    # torch's own list of dependencies for this platform, minus the GPU-only Python packages.
    lister = (
        "import importlib.metadata as md, json\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "out = []\n"
        "for r in md.requires('torch') or []:\n"
        "    req = Requirement(r)\n"
        "    if req.marker is not None and not req.marker.evaluate({'extra': ''}):\n"
        "        continue\n"
        "    out.append((req.name, str(req)))\n"
        "print(json.dumps(out))\n"
    )
    res = run_checked(
        [str(py), "-c", lister], "reading torch's dependencies", capture_output=True, text=True
    )
    deps = [spec for name, spec in json.loads(res.stdout) if name.lower() not in SKIP_DEPS]
    # Requirement strings keep their markers; pip re-evaluates them.
    log("installing torch's dependencies except " + ", ".join(sorted(SKIP_DEPS)) + ", plus numpy")
    run_checked(pip + deps + ["numpy"], "pip install torch's dependencies")
    if not torch_works(py):
        sys.exit(
            f"error: torch is installed in {venv} but `import torch` or SDPA fails; "
            f"delete {venv} and run again, or check {py} -c 'import torch'"
        )
    log(f"torch ready in {venv} after {time.monotonic() - t0:.0f} s")


def ensure_venv(args: argparse.Namespace) -> None:
    """Re-executes this script inside the venv that has torch, creating it first if needed."""
    venv = Path(args.venv).resolve()
    if Path(sys.prefix).resolve() == venv:
        return
    py = venv_python(venv)
    if not (py.exists() and torch_works(py)):
        install_torch(venv, args.torch_version)
    if args.setup_only:
        sys.exit(0)
    os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])


def build_binary(args: argparse.Namespace) -> Path:
    binary = Path(args.binary).resolve() if args.binary else ROOT / "target" / "release" / "flashattn"
    if not args.no_build and not args.binary:
        log("cargo build --release -p flashattn-cli")
        run_checked(
            ["cargo", "build", "--release", "-q", "-p", "flashattn-cli"],
            "building flashattn",
            cwd=ROOT,
        )
    if not binary.exists():
        sys.exit(f"error: {binary} does not exist (build it, or pass --binary)")
    return binary


# ---- measurements --------------------------------------------------------------------------------


def visible_pairs(n: int, causal: bool) -> int:
    return n * (n + 1) // 2 if causal else n * n


def flops(batch: int, heads: int, n: int, d: int, causal: bool, backward: bool) -> float:
    f = 4.0 * batch * heads * d * visible_pairs(n, causal)
    return f * 3.5 if backward else f


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(fn, min_time: float) -> tuple[float, float, int]:
    """`flashattn bench`'s rule: a warm-up call, then timed repeats until `min_time` seconds are
    spent (at least 3, or 1 when the warm-up alone took `min_time`). Returns (median s, min s, reps)."""
    t = time.perf_counter()
    fn()
    warm = time.perf_counter() - t
    min_reps = 1 if warm >= min_time else 3
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (spent < min_time and len(times) < MAX_REPS):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return median(times), min(times), len(times)


def flashattn_run(binary: Path, shape: dict, args: argparse.Namespace, naive: bool) -> list[dict]:
    cmd = [
        str(binary), "bench", "--json", "--no-peak",
        "--batch", str(shape["batch"]), "--heads", str(shape["heads"]),
        "--seqlen", str(shape["seqlen"]), "--head-dim", str(shape["head_dim"]),
        "--dtype", shape["dtype"], "--threads", str(args.threads),
        "--min-time", str(args.min_time),
    ]
    if shape["causal"]:
        cmd.append("--causal")
    if shape["pass"] == "fwd+bwd":
        cmd.append("--backward")
    if not naive:
        cmd.append("--no-naive")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{res.stderr.strip()}")
    lines = [json.loads(l) for l in res.stdout.splitlines() if l.strip()]
    return [l for l in lines if l.get("kind", "measurement") == "measurement"]


# FP8 formats: torch dtype, largest finite value, the descale factor both sides use (a power of two
# taking the max to 1.75, so the dequantised values are exact in bf16).
FP8 = {"e4m3": ("float8_e4m3fn", 448.0, 2.0**-8), "e5m2": ("float8_e5m2", 57344.0, 2.0**-15)}


class TorchCase:
    """Inputs of one shape in torch's layout, kept across rounds."""

    def __init__(self, torch, shape: dict):
        self.torch = torch
        self.F = torch.nn.functional
        b, h, n, d = shape["batch"], shape["heads"], shape["seqlen"], shape["head_dim"]
        g = torch.Generator().manual_seed(0)
        self.fp8 = shape["dtype"] in FP8
        if self.fp8:
            # FP8 over the format's range with a power-of-two descale factor, like `flashattn
            # bench --dtype e4m3|e5m2`. Torch's CPU SDPA rejects FP8 tensors (2.15: "not
            # implemented for 'Float8_e4m3fn'"), so each call dequantises to bf16 first, as a
            # user would, and that conversion is timed with it.
            dt8, fmax, self.descale = FP8[shape["dtype"]]
            dt8 = getattr(torch, dt8)
            mk = lambda: ((torch.rand(b, h, n, d, generator=g) * 2 - 1) * fmax).to(dt8)
        else:
            dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[shape["dtype"]]
            # Uniform in [-1, 1), like `flashattn bench`'s inputs.
            mk = lambda: (torch.rand(b, h, n, d, generator=g) * 2 - 1).to(dt)
        self.causal = shape["causal"]
        self.backward = shape["pass"] == "fwd+bwd"
        self.q, self.k, self.v = mk(), mk(), mk()
        if self.backward:
            self.dout = mk()
            for t in (self.q, self.k, self.v):
                t.requires_grad_(True)

    def call(self) -> None:
        if self.backward:
            for t in (self.q, self.k, self.v):
                t.grad = None
            out = self.F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.causal)
            out.backward(self.dout)
        elif self.fp8:
            with self.torch.inference_mode():
                bf, s = self.torch.bfloat16, self.descale
                q, k, v = (t.to(bf) * s for t in (self.q, self.k, self.v))
                self.F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            with self.torch.inference_mode():
                self.F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=self.causal)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process (torch's threads included) and of its finished children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OthersMeter:
    """Average number of cores that *other* processes kept busy since `start()`: the machine's busy
    CPU time minus this process's and its children's, over the wall time. 0 on a quiet machine."""

    def start(self) -> None:
        self.t, self.busy, self.own = time.monotonic(), busy_cpu_s(), own_cpu_s()

    def cores(self) -> float:
        wall = time.monotonic() - self.t
        foreign = (busy_cpu_s() - self.busy) - (own_cpu_s() - self.own)
        return max(0.0, foreign / wall) if wall > 0 else 0.0


def wait_quiet(limit_s: float, threshold: float) -> float:
    """Waits (at most `limit_s`) until other processes use under `threshold` cores over 5 s;
    returns the seconds waited."""
    t0 = time.monotonic()
    m = OthersMeter()
    while time.monotonic() - t0 < limit_s:
        m.start()
        time.sleep(5)
        if m.cores() < threshold:
            break
    return time.monotonic() - t0


def peak_for(machine: dict, dtype: str) -> float | None:
    """The peak a dtype's GFLOP/s are compared with: bf16 dot products when the kernels use them."""
    if dtype in ("bf16", *FP8) and "+bf16" in (machine.get("isa") or "") and machine.get("peak_bf16_gflops"):
        return machine["peak_bf16_gflops"]
    return machine.get("peak_f32_gflops")


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]
    strs = lambda s: [x for x in s.split(",") if x]
    p = argparse.ArgumentParser(
        description="Time flashattn and PyTorch's CPU scaled_dot_product_attention on the same "
        "shapes, interleaved; see the module docstring.",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument("--heads", type=int, default=None, help="default 16 (4 with --quick)")
    p.add_argument("--head-dim", type=ints, default=None, help="comma list; default 64,128")
    p.add_argument("--seqlen", type=ints, default=None, help="comma list; default 512,...,8192")
    p.add_argument("--dtype", type=strs, default=None,
                   help="comma list of f32,bf16,f16,e4m3,e5m2; default f32,bf16 (e4m3/e5m2: FP8 "
                        "inputs, forward only; torch dequantises them to bf16 in each call)")
    mask = p.add_mutually_exclusive_group()
    mask.add_argument("--causal-only", action="store_true")
    mask.add_argument("--no-causal", action="store_true")
    passes = p.add_mutually_exclusive_group()
    passes.add_argument("--backward", action="store_true", help="time forward+backward only")
    passes.add_argument("--both-passes", action="store_true", help="forward, and forward+backward")
    p.add_argument("--backward-max-seqlen", type=int, default=None,
                   help="time forward+backward only up to this length (default: every length)")
    p.add_argument("--rounds", type=int, default=None, help="alternations per shape; default 3")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds of timed repeats per run; default 0.3")
    p.add_argument("--naive-max-seqlen", type=int, default=None,
                   help="measure naive attention up to this length; default 4096 (0: never)")
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--max-others", type=float, default=0.1,
                   help="cores other processes may use during a shape before it is measured "
                   "again (default 0.1)")
    p.add_argument("--retries", type=int, default=2,
                   help="re-measurements of a disturbed shape (default 2; 0: never)")
    p.add_argument("--wait-quiet", type=float, default=300,
                   help="seconds to wait for a quiet machine before a re-measurement (default 300)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 4 heads, N 256,512, d 64, 2 rounds, short timings")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--svg", default=None, help="also draw the results with `flashattn plot`")
    p.add_argument("--binary", default=None, help="flashattn binary to use (skips the build)")
    p.add_argument("--no-build", action="store_true", help="use target/release/flashattn as it is")
    p.add_argument("--venv", default=str(DEFAULT_VENV))
    p.add_argument("--torch-version", default=TORCH_VERSION)
    p.add_argument("--setup-only", action="store_true", help="install torch into the venv and stop")
    a = p.parse_args(argv)
    quick = a.quick
    fill = lambda v, normal, q: v if v is not None else (q if quick else normal)
    a.batch = fill(a.batch, 1, 1)
    a.heads = fill(a.heads, 16, 4)
    a.head_dim = fill(a.head_dim, [64, 128], [64])
    a.seqlen = fill(a.seqlen, [512, 1024, 2048, 4096, 8192], [256, 512])
    a.dtype = fill(a.dtype, ["f32", "bf16"], ["f32", "bf16"])
    a.rounds = fill(a.rounds, 3, 2)
    a.min_time = fill(a.min_time, 0.3, 0.05)
    a.naive_max_seqlen = fill(a.naive_max_seqlen, 4096, 512)
    bad = [d for d in a.dtype if d not in ("f32", "bf16", "f16", *FP8)]
    if bad:
        p.error(f"unknown --dtype {bad}; use f32, bf16, f16, e4m3, e5m2")
    if (a.backward or a.both_passes) and any(d in FP8 for d in a.dtype):
        p.error("FP8 (e4m3, e5m2) has a forward pass only")
    if a.threads < 1 or a.rounds < 1 or a.batch < 1 or a.heads < 1 or a.min_time < 0:
        p.error("--threads, --rounds, --batch, --heads must be >= 1 and --min-time >= 0")
    if not a.seqlen or min(a.seqlen) < 1 or not a.head_dim or min(a.head_dim) < 1:
        p.error("--seqlen and --head-dim need positive values")
    a.causals = [True] if a.causal_only else [False] if a.no_causal else [False, True]
    a.passes = ["fwd+bwd"] if a.backward else ["fwd", "fwd+bwd"] if a.both_passes else ["fwd"]
    today = _dt.date.today().isoformat()
    if a.out is None:
        name = f"quick_{today}.json" if quick else f"compare_{today}.json"
        a.out = str(ROOT / "bench" / "results" / name)
    return a


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    args = parse_args(sys.argv[1:])
    ensure_venv(args)  # re-executes inside the venv unless already there
    if args.setup_only:
        return
    import torch  # noqa: E402 (only importable inside the venv)

    binary = build_binary(args)
    torch.set_num_threads(args.threads)

    # The peak, measured again (like a disturbed shape) if other processes took CPU time meanwhile.
    meter = OthersMeter()
    for attempt in range(args.retries + 1):
        meter.start()
        peak = subprocess.run(
            [str(binary), "peak", "--json", "--threads", str(args.threads)],
            capture_output=True, text=True,
        )
        peak_others = meter.cores()
        if peak_others <= args.max_others or attempt == args.retries:
            break
        log(f"other processes used {peak_others:.2f} cores while measuring the peak; waiting")
        wait_quiet(args.wait_quiet, args.max_others / 2)
    machine: dict = {"peak_others_cores": peak_others}
    if peak.returncode == 0 and peak.stdout.strip():
        machine.update(json.loads(peak.stdout.strip().splitlines()[-1]))
        machine.pop("kind", None)
    else:
        log(f"warning: `flashattn peak` failed: {peak.stderr.strip()}")
    machine.update(
        threads=args.threads,
        cpu_model=cpu_model(),
        nproc=os.cpu_count(),
        loadavg_start=list(os.getloadavg()),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        python=platform.python_version(),
        flashattn_binary=str(binary),
    )
    # The commit of the checkout the binary was built in (and whether its library had edits).
    try:
        git = ["git", "-C", str(binary.parent)]
        rev = subprocess.run(git + ["rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", ":/flashattn"],
                               capture_output=True, text=True).stdout.strip()
        if rev:
            machine["flashattn_git"] = rev + ("+uncommitted library changes" if dirty else "")
    except OSError:
        pass
    # Outside a checkout (a copied binary) only its build time tells which commit it is.
    machine.setdefault("flashattn_git", None)
    machine["flashattn_binary_mtime"] = _dt.datetime.fromtimestamp(
        binary.stat().st_mtime, _dt.timezone.utc).isoformat(timespec="seconds")

    doc = {
        "format": "flashattn-compare/1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "machine": machine,
        "settings": {
            "rounds": args.rounds,
            "min_time": args.min_time,
            "naive_max_seqlen": 0 if args.no_naive else args.naive_max_seqlen,
            "flop_model": FLOP_MODEL,
            "layouts": {
                "flashattn": "[batch, seqlen, heads, head_dim] (its own)",
                "torch_sdpa": "[batch, heads, seqlen, head_dim] (its own)",
                "naive": "[batch, seqlen, heads, head_dim]",
            },
            "statistic": "median over rounds of each run's median; naive: one run",
        },
        "results": [],
        "ratios": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        machine["loadavg_end"] = list(os.getloadavg())
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)

    shapes = [
        dict(batch=args.batch, heads=args.heads, seqlen=n, head_dim=d, dtype=dt, causal=c, **{"pass": ps})
        for ps in args.passes
        for dt in args.dtype
        for d in args.head_dim
        for c in args.causals
        for n in args.seqlen
        if ps == "fwd" or args.backward_max_seqlen is None or n <= args.backward_max_seqlen
    ]
    print(
        f"flashattn vs torch {torch.__version__} SDPA: {args.threads} threads, batch {args.batch}, "
        f"heads {args.heads}; ISA {machine.get('isa')}, peak f32 {fmt(machine.get('peak_f32_gflops'))} / "
        f"bf16 dot {fmt(machine.get('peak_bf16_gflops'))} GFLOP/s; {args.rounds} rounds, "
        f"min-time {args.min_time} s; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    header = (f"{'dtype':<5} {'d':>4} {'mask':<6} {'pass':<7} {'N':>6} {'flashattn':>10} "
              f"{'torch':>10} {'naive':>10} {'flash/torch':>12} {'flash %pk':>10} {'torch %pk':>10}"
              f" {'others':>6}")
    print("GFLOP/s (median); others: cores other processes used meanwhile (0 = quiet machine)\n"
          + header, flush=True)
    t_start = time.monotonic()
    for shape in shapes:
        n, causal, backward = shape["seqlen"], shape["causal"], shape["pass"] == "fwd+bwd"
        f = flops(shape["batch"], shape["heads"], n, shape["head_dim"], causal, backward)
        case = TorchCase(torch, shape)
        want_naive = not args.no_naive and n <= args.naive_max_seqlen
        best = None
        attempts, waited = 0, 0.0
        # A shape measured while other processes took CPU time is measured again once the machine
        # is quiet (up to --retries times); the attempt with the least interference is kept.
        while True:
            attempts += 1
            load = os.getloadavg()[0]
            meter.start()
            fl_ms, fl_err, t_ms, naive_rec = [], None, [], None
            for r in range(args.rounds):
                lines = flashattn_run(binary, shape, args, naive=want_naive and r == 0)
                fa = next(l for l in lines if l["impl"] == "flashattn")
                fl_ms.append(fa["median_ms"])
                fl_err = fa.get("max_abs_err")
                if r == 0:
                    naive_rec = next((l for l in lines if l["impl"] == "naive"), None)
                time.sleep(0.05)
                med, _, _ = measure(case.call, args.min_time)
                t_ms.append(med * 1e3)
            others = meter.cores()
            if best is None or others < best[0]:
                best = (others, load, fl_ms, fl_err, t_ms, naive_rec)
            if others <= args.max_others or attempts > args.retries:
                break
            log(f"  other processes used {others:.2f} cores during N={n}; waiting for a quiet "
                f"machine and measuring again")
            waited += wait_quiet(args.wait_quiet, args.max_others / 2)
        others, load, fl_ms, fl_err, t_ms, naive_rec = best
        del case
        base = {k: shape[k] for k in ("dtype", "batch", "heads", "head_dim", "causal", "pass")}
        base.update(seqlen_q=n, seqlen_k=n, threads=args.threads, flops=f, loadavg=load,
                    others_cores=others, attempts=attempts)
        pk = peak_for(machine, shape["dtype"])

        def rec(impl: str, samples: list[float], layout: str, **extra) -> dict:
            ms = median(samples)
            g = f / (ms / 1e3) / 1e9
            return dict(impl=impl, **base, median_ms=ms, gflops=g, samples_ms=samples,
                        min_ms=min(samples), peak_fraction=(g / pk if pk else None),
                        layout=layout, **extra)

        fa_rec = rec("flashattn", fl_ms, "[B,N,H,d]", max_abs_err=fl_err)
        to_rec = rec("torch_sdpa", t_ms, "[B,H,N,d]")
        doc["results"] += [fa_rec, to_rec]
        na_g = None
        if naive_rec is not None and not naive_rec.get("skipped"):
            na = rec("naive", [naive_rec["median_ms"]], "[B,N,H,d]",
                     max_abs_err=naive_rec.get("max_abs_err"),
                     peak_extra_bytes=naive_rec.get("peak_extra_bytes"))
            doc["results"].append(na)
            na_g = na["gflops"]
        ratio = fa_rec["gflops"] / to_rec["gflops"]
        doc["ratios"].append(dict(
            dtype=shape["dtype"], head_dim=shape["head_dim"], causal=causal, **{"pass": shape["pass"]},
            seqlen=n, flashattn_gflops=fa_rec["gflops"], torch_gflops=to_rec["gflops"],
            naive_gflops=na_g, flashattn_over_torch=ratio,
        ))
        save()
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
        print(f"{shape['dtype']:<5} {shape['head_dim']:>4} {'causal' if causal else 'full':<6} "
              f"{shape['pass']:<7} {n:>6} {fa_rec['gflops']:>10.1f} {to_rec['gflops']:>10.1f} "
              f"{fmt(na_g):>10} {ratio:>11.2f}x {pct(fa_rec['peak_fraction']):>10} "
              f"{pct(to_rec['peak_fraction']):>10} {others:>6.2f}", flush=True)
    ratios = [r["flashattn_over_torch"] for r in doc["ratios"]]
    geo = statistics.geometric_mean(ratios) if ratios else float("nan")
    print(f"{len(shapes)} shapes in {time.monotonic() - t_start:.0f} s; flashattn/torch geometric "
          f"mean {geo:.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x); "
          f"load average now {os.getloadavg()[0]:.2f}; results in {out}", flush=True)
    disturbed = sorted({(r["dtype"], r["head_dim"], r["causal"], r["pass"], r["seqlen_q"])
                        for r in doc["results"] if r["others_cores"] > args.max_others})
    remeasured = sum(1 for r in doc["results"] if r["impl"] == "flashattn" and r["attempts"] > 1)
    print(f"{remeasured} shapes measured again for interference; {len(disturbed)} still above "
          f"--max-others {args.max_others} cores of other processes" +
          (f": {disturbed}" if disturbed else ""), flush=True)
    doc["summary"] = {"shapes": len(shapes), "seconds": time.monotonic() - t_start,
                      "flashattn_over_torch_geomean": geo, "remeasured_shapes": remeasured,
                      "disturbed_shapes": [list(d) for d in disturbed]}
    save()
    if args.svg:
        svg = Path(args.svg)
        svg.parent.mkdir(parents=True, exist_ok=True)
        run_checked([str(binary), "plot", str(out), str(svg)], "flashattn plot")
        print(f"plot: {svg}", flush=True)


if __name__ == "__main__":
    main()
