//! CUDA kernel variants compile with NVRTC for sm_80 (Ampere) and sm_90a (Hopper), with no
//! register spills. By default a representative subset (~7% of the variants, ~4 CPU-minutes):
//! every kernel family (kind, dtype, tensor-core or not) at one head dim (96; 128 for the sm_90a
//! forward; the smallest where a family starts above that) with no option, all of them, and all
//! but one; in every tile configuration (family and tiles) the variants with the most options at
//! its largest head dim, where registers run out first (256 with dropout, softcap and ALiBi; in bf16
//! and f32, f16 being bf16's code with another element type); the sm_90a backward's tile
//! configurations with their fewest and most options, in bf16; and
//! the decode combine/append and backward prep kernels (see `representative`).
//! `FLASHATTN_COMPILE_ALL=1` compiles every variant (~65 CPU-minutes, about half an hour on 2
//! cores). Needs only libnvrtc, no GPU:
//! CI installs `nvidia-cuda-nvrtc==13.0.88` from PyPI and sets `FLASHATTN_REQUIRE_NVRTC=1`, which
//! turns a missing NVRTC into a failure; elsewhere the test says why it skips. The per-variant
//! table (registers, spills, compile time) goes to `target/cuda_compile_report.txt`, which
//! `.ci/run` prints. It also fails on ptxas's warnings that `setmaxnreg` was ignored or `wgmma`
//! serialised, and, with `FLASHATTN_CUOBJDUMP` (CI installs it), on sm_90a kernels whose machine
//! code lacks the Hopper instructions they were written for.
#![cfg(feature = "cuda")]

use flashattn::cuda::{self, Arch, KernelKey, KernelKind};
use rayon::prelude::*;
use std::fmt::Write;
use std::time::Duration;

#[test]
fn every_kernel_variant_compiles_without_spills() {
    let required = std::env::var("FLASHATTN_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    let version = match cuda::nvrtc_version() {
        Ok(v) => v,
        Err(e) if required => panic!("FLASHATTN_REQUIRE_NVRTC=1 but {e}"),
        Err(e) => {
            eprintln!("skipping the NVRTC compile test: {e}");
            return;
        }
    };
    // FLASHATTN_COMPILE_FILTER=text[,text..] keeps the variants whose name contains one of the
    // texts (while working on one kernel); CI compiles them all.
    let filter = std::env::var("FLASHATTN_COMPILE_FILTER").unwrap_or_default();
    let all = std::env::var("FLASHATTN_COMPILE_ALL").is_ok_and(|v| v == "1");
    let keys = KernelKey::all();
    let subset = representative(&keys);
    let jobs: Vec<(KernelKey, Arch)> = keys
        .iter()
        .copied()
        .filter(|k| all || subset.contains(k))
        .filter(|k| filter.split(',').any(|f| k.name().contains(f)))
        .flat_map(|k| [(k, Arch::SM80), (k, Arch::SM90)])
        .filter(|(k, arch)| k.builds_for(*arch))
        .collect();
    let variants = jobs
        .iter()
        .map(|(k, _)| *k)
        .collect::<std::collections::HashSet<_>>()
        .len();
    let results: Vec<_> = jobs
        .par_iter()
        .map(|(key, arch)| (key, arch, cuda::compile(key, *arch)))
        .collect();

    let mut report = format!(
        "NVRTC {}.{}: {} kernel variants, {} compiles for sm_80 and sm_90a ({})\n\
         {:<48} {:>7} {:>5} {:>7} {:>7} {:>8} {:>9}\n",
        version.0,
        version.1,
        variants,
        jobs.len(),
        if all {
            "all"
        } else {
            "representative subset; FLASHATTN_COMPILE_ALL=1 for all"
        },
        "kernel",
        "arch",
        "regs",
        "spill_st",
        "spill_ld",
        "smem_B",
        "compile_s"
    );
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    for (key, arch, r) in &results {
        match r {
            Ok(c) => {
                slowest = slowest.max(c.compile_time);
                let _ = writeln!(
                    report,
                    "{:<48} {:>7} {:>5} {:>7} {:>7} {:>8} {:>9.3}",
                    key.name(),
                    arch.target(),
                    c.registers.map_or("?".into(), |r| r.to_string()),
                    c.spill_stores.map_or("?".into(), |r| r.to_string()),
                    c.spill_loads.map_or("?".into(), |r| r.to_string()),
                    key.smem_bytes(),
                    c.compile_time.as_secs_f64()
                );
                if c.cubin.is_empty() {
                    failures.push(format!("{} {arch}: empty cubin", key.name()));
                }
                // ptxas's warnings that setmaxnreg was ignored (C7508) or that wgmma was
                // serialised (C7510 across a function boundary, C7512 short of registers, and
                // the other C75xx "serialized" reasons) mean a slow kernel, not a wrong one:
                // the gate fails on them.
                if ["C7508", "C7510", "C7512"]
                    .iter()
                    .any(|w| c.log.contains(w))
                    || c.log.contains("serialized")
                {
                    failures.push(format!("{} {arch}: ptxas warns:\n{}", key.name(), c.log));
                }
                match (c.registers, c.spill_stores, c.spill_loads) {
                    (Some(_), Some(0), Some(0)) => {}
                    (Some(_), Some(st), Some(ld)) => failures.push(format!(
                        "{} {arch}: spills {st} bytes stored, {ld} loaded",
                        key.name()
                    )),
                    _ => failures.push(format!(
                        "{} {arch}: no resource usage in the log:\n{}",
                        key.name(),
                        c.log
                    )),
                }
            }
            Err(e) => failures.push(format!("{} {arch}: {e}", key.name())),
        }
    }
    failures.extend(sass_failures(&results));
    let _ = writeln!(
        report,
        "slowest compile {:.3} s; {} failures",
        slowest.as_secs_f64(),
        failures.len()
    );
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda_compile_report.txt");
    let _ = std::fs::write(&path, &report);
    assert!(
        failures.is_empty(),
        "{} of {} compiles failed:\n{}",
        failures.len(),
        results.len(),
        failures.join("\n")
    );
}

/// The variants compiled by default. A family is a kernel kind and dtype on CUDA cores or on
/// tensor cores (`_tc`), a tile configuration a family's head dims and options that share
/// [`KernelKey::tiles`]. Taken:
/// - at each family's base head dim (96, not a power of two; the sm_90a forward's dims are
///   multiples of 64: 128; a family that starts above that: its smallest), no option (but
///   those the family always has), all of them, and all but one: every option's code on and
///   off, with the others on and off;
/// - in each tile configuration, at its largest head dim, the variants with the most options:
///   the most registers live for those tiles, where spills appear first (in bf16, not f16: the
///   same kernels with another element type);
/// - the kernels with no head dim (decode combine and append, backward prep).
fn representative(keys: &[KernelKey]) -> std::collections::HashSet<KernelKey> {
    struct Info {
        key: KernelKey,
        family: (KernelKind, flashattn::DType, bool),
        tiles: (usize, usize, usize),
        options: usize,
    }
    let infos: Vec<Info> = keys
        .iter()
        .map(|&key| {
            let t = key.tiles();
            Info {
                key,
                // The FP8 sm_90a forwards (fwd_sm90_fp8.cu, fwd_sm90_ws.cu's FP8 mode) are
                // families of their own.
                family: (
                    key.kind,
                    key.dtype,
                    key.name().contains("_tc") || (key.is_sm90() && key.fp8),
                ),
                tiles: (t.block_m, t.block_n, t.num_warps),
                options: [
                    key.masked,
                    key.softcap,
                    key.alibi,
                    key.dropout,
                    key.vec_load,
                    key.fp8,
                ]
                .into_iter()
                .filter(|&on| on)
                .count(),
            }
        })
        .collect();
    let base_dim = |i: &Info| {
        let want = if i.key.is_sm90() { 128 } else { 96 };
        let dims = || {
            infos
                .iter()
                .filter(|o| o.family == i.family)
                .map(|o| o.key.head_dim)
        };
        if dims().any(|d| d == want) {
            want
        } else {
            dims().min().unwrap_or(want)
        }
    };
    // The fewest and the most options of the variants `of` takes.
    let span = |of: &dyn Fn(&Info) -> bool| {
        infos
            .iter()
            .filter(|o| of(o))
            .fold((usize::MAX, 0), |(lo, hi), o| {
                (lo.min(o.options), hi.max(o.options))
            })
    };
    let mut subset = std::collections::HashSet::new();
    for i in &infos {
        let helper = matches!(
            i.key.kind,
            KernelKind::DecodeCombine | KernelKind::DecodeAppend | KernelKind::BackwardPrep
        );
        let at_base = i.key.head_dim == base_dim(i) && {
            // Fewest: the sm_90a forward and the tensor-core decode always load vectors.
            let same = |o: &Info| o.family == i.family && o.key.head_dim == i.key.head_dim;
            let (fewest, most) = span(&same);
            i.options == fewest || i.options + 1 >= most
        };
        let same_tiles = |o: &Info| (o.family, o.tiles) == (i.family, i.tiles);
        let dmax = infos
            .iter()
            .filter(|o| same_tiles(o))
            .map(|o| o.key.head_dim)
            .max()
            .unwrap_or(0);
        if matches!(
            i.key.kind,
            KernelKind::BackwardDqSm90 | KernelKind::BackwardDkDvSm90
        ) {
            // bwd_sm90.cu: its options' code is bwd.cu's tensor-core kernels' (compiled in
            // every combination above), so in bf16 only, each tile configuration's fewest and
            // most options at its largest head dim (six variants).
            let (fewest, most) = span(&|o| same_tiles(o) && o.key.head_dim == dmax);
            if i.key.dtype == flashattn::DType::BF16
                && i.key.head_dim == dmax
                && (i.options == fewest || i.options == most)
            {
                subset.insert(i.key);
            }
            continue;
        }
        // f16's kernels are bf16's with another element type: the variants where spills appear
        // first compile in bf16, f16 at the base head dim only.
        let top_of_tiles = i.key.dtype != flashattn::DType::F16
            && i.key.head_dim == dmax
            && i.options == span(&|o| same_tiles(o) && o.key.head_dim == dmax).1;
        if helper || at_base || top_of_tiles {
            subset.insert(i.key);
        }
    }
    subset
}

/// The machine code of the sm_90a kernels uses the Hopper instructions they were written for:
/// `HGMMA` (wgmma; `QGMMA` for the FP8 one's e4m3 operands), and in the warp-specialised one
/// `UTMALDG` (TMA loads),
/// `USETMAXREG` (register reallocation) and `ATOM` or `RED` (its dynamic scheduler's tile counter). Needs `cuobjdump` (with `nvdisasm` beside it or on the
/// path) at `FLASHATTN_CUOBJDUMP`; CI installs both from PyPI. Unset: the check says it skips.
fn sass_failures(
    results: &[(&KernelKey, &Arch, flashattn::Result<cuda::CompiledKernel>)],
) -> Vec<String> {
    let Some(tool) = std::env::var_os("FLASHATTN_CUOBJDUMP") else {
        eprintln!("skipping the SASS check of the sm_90a kernels: FLASHATTN_CUOBJDUMP is not set");
        return Vec::new();
    };
    let tool = std::path::PathBuf::from(tool);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda_sass");
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (key, arch, r) in results {
        let Ok(c) = r else { continue };
        if !key.is_sm90() || **arch != Arch::SM90 {
            continue;
        }
        let path = dir.join(format!("{}.cubin", key.name()));
        std::fs::write(&path, &c.cubin).unwrap();
        let mut cmd = std::process::Command::new(&tool);
        if let Some(bin) = tool.parent() {
            // cuobjdump runs nvdisasm, found beside it.
            cmd.env("NVDISASM_PATH", bin);
        }
        let out = cmd.arg("--dump-sass").arg(&path).output();
        let _ = std::fs::remove_file(&path);
        let sass = match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
            Ok(o) => {
                failures.push(format!(
                    "{}: cuobjdump failed: {}",
                    key.name(),
                    String::from_utf8_lossy(&o.stderr)
                ));
                continue;
            }
            Err(e) => {
                failures.push(format!(
                    "{}: cannot run {}: {e}",
                    key.name(),
                    tool.display()
                ));
                continue;
            }
        };
        let wanted: &[&str] = if key.kind == KernelKind::ForwardSm90Ws && key.fp8 {
            // fwd_sm90_ws.cu's FP8 mode: wgmma with e4m3 operands, TMA, setmaxnreg.
            &["QGMMA", "UTMALDG", "USETMAXREG"]
        } else if key.kind == KernelKind::ForwardSm90Ws {
            &["HGMMA", "UTMALDG", "USETMAXREG"]
        } else if key.fp8 {
            // fwd_sm90_fp8.cu: wgmma with e4m3 operands.
            &["QGMMA"]
        } else {
            &["HGMMA"]
        };
        for w in wanted {
            if !sass.contains(w) {
                failures.push(format!("{} sm_90a: no {w} in its SASS", key.name()));
            }
        }
        // fwd_sm90_ws.cu's dynamic tile scheduler (a runtime choice, compiled into every
        // variant): the producer's atomicAdd on the tile counter (ATOMG, or RED where the old
        // value went unused).
        if key.kind == KernelKind::ForwardSm90Ws && !sass.contains("ATOM") && !sass.contains("RED")
        {
            failures.push(format!(
                "{} sm_90a: no ATOM or RED (the tile counter) in its SASS",
                key.name()
            ));
        }
        checked += 1;
    }
    eprintln!(
        "SASS of {checked} sm_90a variants checked for HGMMA or QGMMA (and UTMALDG, USETMAXREG)"
    );
    failures
}

/// A kernel that does not compile gives a typed error carrying NVRTC's log, not a panic.
#[test]
fn compile_errors_carry_the_log() {
    if cuda::nvrtc_version().is_err() {
        eprintln!("skipping: no NVRTC");
        return;
    }
    // head_dim 8 is not a multiple of HEAD_DIM_STEP: the tensor-core kernel's static tile
    // arithmetic breaks (and the public API never builds such a key).
    let key = KernelKey {
        kind: flashattn::cuda::KernelKind::Forward,
        dtype: flashattn::DType::BF16,
        head_dim: 8,
        masked: false,
        softcap: false,
        alibi: false,
        dropout: false,
        vec_load: true,
        fp8: false,
    };
    match cuda::compile(&key, Arch::SM80) {
        Err(e) => match e.kind() {
            flashattn::ErrorKind::KernelCompile { kernel, log, .. } => {
                assert_eq!(kernel, &key.name());
                assert!(!log.is_empty());
            }
            other => panic!("expected KernelCompile, got {other:?}"),
        },
        Ok(c) => panic!("head_dim 8 compiled unexpectedly:\n{}", c.log),
    }
}
