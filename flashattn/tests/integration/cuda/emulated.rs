//! The CUDA kernels' own source, run on the CPU: `kernels/host_emulation.h` stands in for the CUDA
//! primitives (threads, barriers, ldmatrix, mma.sync, shuffles, cp.async) and g++ compiles
//! fwd.cu / fwd_f32.cu with it. Each case takes the launch the GPU path would make
//! (`flashattn::cuda::launch_description`: kernel variant, grid, sequence table, strides, window
//! clamping) and checks the result against the f64 reference with the same bound as the CPU and GPU
//! tests. This checks the kernels' indexing, fragment layouts, swizzle, masking, pipelining and
//! online softmax on a machine without a GPU; it cannot check timing or true hardware races.
//!
//! Needs g++ (C++17). Without it the test says why it skips; CI sets FLASHATTN_REQUIRE_EMULATION=1,
//! which makes a missing compiler a failure.
#![cfg(feature = "cuda")]

use crate::common;

use crate::common::emu::{bytes, forward_builds, have_compiler, run_forward, Builds};
use crate::common::grid::grid;
use crate::common::*;
use flashattn::cuda::{launch_description, Arch, ForwardKernel, LaunchDescription};
use flashattn::{AttnOutput, DType, TensorRef};

/// Runs the emulated kernel of `d` on the buffers behind q, k, v.
pub(super) fn run(
    builds: &mut Builds,
    d: &LaunchDescription,
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    tag: &str,
) -> AttnOutput {
    let [qb, kb, vb] = [q, k, v].map(|t| bytes(t.data()));
    run_forward(builds, d, [&qb, &kb, &vb], q.dtype(), tag)
}

/// Reference work allowed per emulated grid case (the emulation runs ~1e2-1e3x slower than the
/// CPU path).
fn budget() -> usize {
    common::emu::budget(1_000_000)
}

fn run_grid(dtype: DType) {
    if !have_compiler() {
        return;
    }
    let ran = grid_cases(&mut forward_builds(), dtype, None, None);
    eprintln!("{dtype}: {ran} grid cases emulated");
    assert!(
        ran >= 10.min(budget()),
        "too few cases fit the emulation budget: {ran}"
    );
}

/// Runs the grid cases of `dtype` that fit the emulation budget against the f64 reference; with
/// `sm90`, on that sm_90a kernel, skipping the cases it does not serve; with `ctas`, launched
/// persistent with that many CTAs (the warp-specialised kernel). Returns how many ran.
fn grid_cases(
    builds: &mut Builds,
    dtype: DType,
    sm90: Option<ForwardKernel>,
    ctas: Option<usize>,
) -> usize {
    let mut ran = 0;
    // The warp-specialised kernel's two launches share the grid: one CTA per tile takes the even
    // cases, the persistent launch the odd ones; fwd.cu's f16 variants, bf16's code with another
    // element type, take the even ones (all of them with FLASHATTN_EMU_ALL=1).
    let twin = sm90.is_none() && dtype == DType::F16;
    let half = (twin || matches!(sm90, Some(ForwardKernel::Sm90Ws))) && !common::emu::all();
    let parity = usize::from(ctas.is_some());
    for (i, case) in grid(dtype).into_iter().enumerate() {
        if case.cost() > budget() || (half && i % 2 != parity) {
            continue;
        }
        let inputs = case.build();
        let (q, k, v) = inputs.views();
        let mut d = launch_description(&q, &k, &v, &inputs.opts()).unwrap();
        if let Some(kernel) = sm90 {
            d = d.for_arch(Arch::SM90, kernel);
            if !d.key.is_sm90() {
                continue; // dropout, or rows not 16-byte aligned: fwd.cu serves those
            }
        }
        if let Some(n) = ctas {
            d = d.persistent(n);
        }
        let tag = format!(
            "{}{dtype}_{i}",
            sm90.map_or(String::new(), |k| format!("{k:?}_"))
        );
        let flash = run(builds, &d, &q, &k, &v, &tag);
        let naive = [inputs.naive(), inputs.naive_sequential()];
        let r = inputs.reference();
        let v_max = inputs.v_values().iter().fold(0f64, |m, x| m.max(x.abs()));
        check_bound(
            &format!("{case} emulated {}", d.key.name()),
            dtype,
            &flash,
            &naive,
            &r,
            v_max,
            case.seqlen_k,
        );
        ran += 1;
    }
    ran
}

#[test]
fn grid_f16() {
    run_grid(DType::F16);
}

#[test]
fn grid_bf16() {
    run_grid(DType::BF16);
}

#[test]
fn grid_f32() {
    run_grid(DType::F32);
}

/// The sm_90a forward (fwd_sm90.cu: wgmma through shared-memory descriptors) on the grid cases it
/// serves, f16 and bf16, with the grid's bound; host_emulation.h reads wgmma's operands at the
/// wait and poisons its accumulators until then.
#[test]
fn grid_sm90() {
    run_grid_sm90(ForwardKernel::Sm90, None);
}

/// The warp-specialised sm_90a forward (fwd_sm90_ws.cu: TMA loads completing on mbarriers, a
/// producer warpgroup and two consumers) on the same cases; host_emulation.h delivers each TMA
/// load only when its barrier is first waited for and aborts on a deadlock.
#[test]
fn grid_sm90_ws() {
    run_grid_sm90(ForwardKernel::Sm90Ws, None);
}

/// The warp-specialised sm_90a forward launched persistent (cuda/schedule.rs) with 3 CTAs, so
/// that each loops over many work tiles (causal ones heaviest first) and its mbarrier phases run
/// on across them: the grid cases (causal and not, GQA, windows), packed sequences and, on every
/// fourth grid case, learnable sinks.
#[test]
fn grid_sm90_ws_persistent() {
    run_grid_sm90(ForwardKernel::Sm90Ws, Some(PERSISTENT_CTAS));
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    for dtype in [DType::BF16, DType::F16] {
        let ran = sink_grid_cases(&mut builds, dtype, "ws_persistent_sink", |d| {
            let d = d
                .for_arch(Arch::SM90, ForwardKernel::Sm90Ws)
                .persistent(PERSISTENT_CTAS);
            d.key.is_sm90().then_some(d)
        });
        eprintln!("{dtype}: {ran} grid cases with sinks emulated on the persistent ws kernel");
        assert!(ran >= 2.min(budget()), "too few sink cases ran: {ran}");
    }
}

/// Every fourth grid case of `dtype` within the budget, with a sink logit per head, on the launch
/// `adapt` makes of the default one (`None`: a case that launch does not serve), against the f64
/// reference with the grid's bound. Returns how many ran.
fn sink_grid_cases(
    builds: &mut Builds,
    dtype: DType,
    tag: &str,
    adapt: impl Fn(LaunchDescription) -> Option<LaunchDescription>,
) -> usize {
    let mut ran = 0;
    for (i, case) in grid(dtype).into_iter().enumerate() {
        if i % 4 != 1 || case.cost() > budget() {
            continue;
        }
        let inputs = case.build();
        let (q, k, v) = inputs.views();
        let sinks = test_sinks(case.heads);
        let opts = inputs
            .opts()
            .learnable_sink(TensorRef::contiguous(&sinks, &[case.heads]));
        let d = launch_description(&q, &k, &v, &opts).unwrap();
        assert!(d.sink.is_some(), "the launch carries the sinks");
        let Some(d) = adapt(d) else { continue };
        let flash = run(builds, &d, &q, &k, &v, &format!("{tag}_{dtype}_{i}"));
        inputs.check_with(&flash, &format!("sinks emulated {}", d.key.name()), &opts);
        ran += 1;
    }
    ran
}

/// CTAs of the emulated persistent launches: few, so that every CTA takes several tiles.
const PERSISTENT_CTAS: usize = 3;

/// The emulation catches a phase mistake of the persistent kernel: fwd_sm90_ws.cu with the
/// consumers' K/V ring position restarted at every tile (the producer's runs on) must fail,
/// deadlocked or wrong, on a causal case whose tiles see odd numbers of key blocks; the kernel
/// as it is passes the same case.
#[test]
fn persistent_ring_phase_mistake_fails() {
    if !have_compiler() {
        return;
    }
    let broken = common::emu::BrokenKernel::new(
        "ws_ring",
        "fwd_sm90_ws.cu",
        "ring += w.n_block_max - w.n_block_min;  // the consumers' ring position",
        "// (ring not advanced)",
    );

    // Six tiles on one CTA.
    let inputs = six_causal_tiles(7).build();
    let (q, k, v) = inputs.views();
    let d = launch_description(&q, &k, &v, &inputs.opts())
        .unwrap()
        .for_arch(Arch::SM90, ForwardKernel::Sm90Ws)
        .persistent(1);
    assert_eq!(d.grid, (1, 1, 1));
    assert_mistake_caught(
        broken,
        &d,
        &inputs,
        "ws_ring",
        "the emulation missed a K/V ring phase restarted at every tile",
    );
}

/// Three query blocks of 128 rows and 320 keys in blocks of 128 (bf16, d = 64): under the
/// bottom-right causal mask they see 1, 2 and 3 key blocks; two heads: six work tiles.
pub(super) fn six_causal_tiles(seed: u64) -> Case {
    Case {
        dtype: DType::BF16,
        seqlen_q: 384,
        seqlen_k: 320,
        heads: 2,
        heads_kv: 2,
        head_dim: 64,
        causal: true,
        seed,
        ..Case::default()
    }
}

/// The launch `d` of `inputs` passes against the f64 reference on the kernel as it is and fails
/// on `broken` (`missed`: the message when it does not); `tag` names the runs' work folders.
pub(super) fn assert_mistake_caught(
    broken: common::emu::BrokenKernel,
    d: &LaunchDescription,
    inputs: &Inputs,
    tag: &str,
    missed: &str,
) {
    let (q, k, v) = inputs.views();
    let good = run(&mut forward_builds(), d, &q, &k, &v, &format!("{tag}_good"));
    inputs.check_with(&good, "the kernel as it is", &inputs.opts());
    let mut builds = forward_builds();
    builds.get(&d.key, &[broken.define()]);
    let prefix = format!("case_{}_{tag}_broken_", std::process::id());
    assert!(
        broken.fails(&prefix, || {
            let out = run(&mut builds, d, &q, &k, &v, &format!("{tag}_broken"));
            inputs.check_with(&out, "the broken kernel", &inputs.opts());
        }),
        "{missed}"
    );
}

fn run_grid_sm90(kernel: ForwardKernel, ctas: Option<usize>) {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    for dtype in [DType::BF16, DType::F16] {
        let ran = grid_cases(&mut builds, dtype, Some(kernel), ctas);
        eprintln!("{dtype}: {ran} grid cases emulated on the sm_90a forward ({kernel:?})");
        assert!(ran >= 5.min(budget()), "too few sm_90a cases ran: {ran}");
        // Packed sequences (the tensor maps then span the whole packed tensor).
        for (n, case) in varlen_cases(dtype, 4, 2, 40).into_iter().enumerate() {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let cu = Some((&inputs.cu_q[..], &inputs.cu_k[..]));
            let mut d = launch_description(
                &q,
                &k,
                &v,
                &flashattn::AttnOptions {
                    cu_seqlens: cu,
                    ..inputs.opts().clone()
                },
            )
            .unwrap()
            .for_arch(Arch::SM90, kernel);
            if let Some(n) = ctas {
                d = d.persistent(n);
            }
            assert!(d.key.is_sm90(), "{}", d.key.name());
            let tag = format!("sm90_varlen_{kernel:?}_{dtype}_{n}");
            let flash = run(&mut builds, &d, &q, &k, &v, &tag);
            inputs.check(&flash, &format!("emulated {}", d.key.name()));
        }
    }
}

/// Every kernel parameter struct of cuda/params.rs has the layout of its mirror in params.cuh:
/// the same size and every field at the same offset, as g++ lays them out (the emulation builds
/// run the kernels on those bytes; NVRTC checks the sizes and some offsets by static_assert).
#[test]
fn params_structs_match_params_cuh() {
    if !have_compiler() {
        return;
    }
    let layouts = flashattn::cuda::params_layouts();
    let mut src = String::from("#include \"params.cuh\"\n#include <cstdio>\nint main() {\n");
    let mut want = Vec::new();
    for s in &layouts {
        let (name, size) = (s.name, s.size);
        src += &format!("    std::printf(\"%zu\\n\", sizeof({name}));\n");
        want.push(format!("sizeof({name}) = {size}"));
        for f in &s.fields {
            let (field, offset) = (f.name, f.offset);
            src += &format!("    std::printf(\"%zu\\n\", __builtin_offsetof({name}, {field}));\n");
            want.push(format!("{name}.{field} at {offset}"));
        }
    }
    src += "    return 0;\n}\n";
    let dir = common::emu::case_dir("params", "probe");
    std::fs::create_dir_all(&dir).unwrap();
    let (cpp, exe) = (dir.join("probe.cpp"), dir.join("probe"));
    std::fs::write(&cpp, src).unwrap();
    let out = std::process::Command::new("g++")
        .args(["-std=c++17", "-DFA_HOST_EMULATION"])
        .arg(format!("-I{}", common::emu::KERNELS))
        .arg(&cpp)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "the probe of params.cuh does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::process::Command::new(&exe)
        .output()
        .expect("run the probe");
    let _ = std::fs::remove_dir_all(&dir);
    let got: Vec<&str> = std::str::from_utf8(&run.stdout).unwrap().lines().collect();
    let want_numbers: Vec<String> = layouts
        .iter()
        .flat_map(|s| {
            std::iter::once(s.size.to_string()).chain(s.fields.iter().map(|f| f.offset.to_string()))
        })
        .collect();
    assert_eq!(got.len(), want.len(), "probe output: {got:?}");
    for ((g, w), what) in got.iter().zip(&want_numbers).zip(&want) {
        assert_eq!(
            g, w,
            "params.cuh differs from cuda/params.rs: want {what}, C has {g}"
        );
    }
}

/// Packed sequences, including empty ones and rows after the last sequence (launched as a tail
/// sequence that sees no key: out 0, lse -inf).
#[test]
fn varlen_matches_reference() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (n, case) in varlen_cases(dtype, 2, 1, 40).into_iter().enumerate() {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let cu = Some((&inputs.cu_q[..], &inputs.cu_k[..]));
            let desc = launch_description(
                &q,
                &k,
                &v,
                &flashattn::AttnOptions {
                    cu_seqlens: cu,
                    ..inputs.opts().clone()
                },
            )
            .unwrap();
            let flash = run(
                &mut builds,
                &desc,
                &q,
                &k,
                &v,
                &format!("varlen_{dtype}_{n}"),
            );
            inputs.check(&flash, "emulated");
        }
    }
}

/// Learnable sinks through the forward kernels: every fourth grid case of each dtype (within the
/// emulation budget) with a sink logit per head, against the f64 reference with the grid's bound
/// (rows that see no key: out 0, lse = the sink); and packed batches, whose rows after the last
/// sequence get no sink (out 0, lse -inf, as on the CPU).
#[test]
fn sinks_match_reference() {
    if !have_compiler() {
        return;
    }
    let mut builds = forward_builds();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let ran = sink_grid_cases(&mut builds, dtype, "sink", Some);
        eprintln!("{dtype}: {ran} grid cases with sinks emulated");
        assert!(ran >= 3.min(budget()), "too few sink cases ran: {ran}");
        for (n, case) in varlen_cases(dtype, 2, 1, 40).into_iter().enumerate() {
            let inputs = case.build();
            let (q, k, v) = inputs.views();
            let sinks = test_sinks(2);
            let opts = inputs
                .opts()
                .learnable_sink(TensorRef::contiguous(&sinks, &[2]));
            let cu = Some((&inputs.cu_q[..], &inputs.cu_k[..]));
            let d = launch_description(
                &q,
                &k,
                &v,
                &flashattn::AttnOptions {
                    cu_seqlens: cu,
                    ..opts.clone()
                },
            )
            .unwrap();
            let flash = run(
                &mut builds,
                &d,
                &q,
                &k,
                &v,
                &format!("sink_varlen_{dtype}_{n}"),
            );
            inputs.check_with(&flash, "emulated with sinks", &opts);
        }
    }
}

/// The backward kernels (bwd.cu) under emulation, against the f64 reference with the CPU
/// backward's bound (`common::backward::check`: 3x the naive backward's error plus a floor).
/// `emulated_bwd90.rs` runs the same cases on the sm_90a kernels of bwd_sm90.cu.
pub(crate) mod backward {
    use super::common::backward::{cases, check, data, GradCase, GradData};
    use super::common::emu::{bytes, case_dir, from_bytes, have_compiler, Builds};
    use flashattn::cuda::{backward_launch_description, launch_description, BackwardLaunch};
    use flashattn::{flash_attn, reference, AttnOptions, Element, Tensor};
    use flashattn::{naive, TensorRef};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    const DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_emu/bwd_driver.cpp");
    const SM90_DRIVER: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/cuda_emu/bwd_sm90_driver.cpp"
    );

    fn builds() -> Builds {
        Builds::new(DRIVER, &[("FA_BWD_ENTRY", "0")])
    }

    /// The builds of bwd_sm90.cu (both of its kernels in one binary, after bwd.cu's prep), keyed
    /// by the launch's `bwd_dq_sm90` key.
    pub(crate) fn sm90_builds() -> Builds {
        Builds::new(SM90_DRIVER, &[("BWD_SM90_ENTRY", "0")])
    }

    /// Runs the emulated prep, dq and dkdv kernels of `d`; returns dq, dk, dv, and with sinks
    /// their gradient as the library computes it from the prep kernel's workspaces.
    pub(crate) fn run(
        builds: &mut Builds,
        d: &BackwardLaunch,
        [q, k, v, out, lse, dout]: [&TensorRef; 6],
        tag: &str,
    ) -> ([Tensor; 3], Option<Tensor>) {
        let dir = case_dir("bwd", tag);
        std::fs::create_dir_all(&dir).unwrap();
        let grid = |g: Option<(u32, u32, u32)>| {
            let g = g.unwrap_or((0, 0, 0));
            [g.0 as i64, g.1 as i64, g.2 as i64]
        };
        let nums: Vec<String> = grid(d.prep_grid())
            .into_iter()
            .chain(grid(d.dq_grid()))
            .chain(grid(d.dkdv_grid()))
            .chain([
                d.dq.smem_bytes() as i64,
                d.dkdv.smem_bytes() as i64,
                d.slopes.is_some() as i64,
                d.dq_len as i64,
                d.dk_len as i64,
                d.lse_len as i64,
            ])
            .map(|x| x.to_string())
            .collect();
        // The kernels' parameter, byte for byte as a GPU launch passes it (its addresses 0: the
        // driver sets them to its buffers).
        std::fs::write(dir.join("params.bin"), d.params.as_bytes()).unwrap();
        std::fs::write(dir.join("params.txt"), nums.join("\n")).unwrap();
        for (name, t) in [
            ("q", q),
            ("k", k),
            ("v", v),
            ("out", out),
            ("dout", dout),
            ("lse", lse),
        ] {
            std::fs::write(dir.join(format!("{name}.bin")), bytes(t.data())).unwrap();
        }
        let le = |x: &[i64]| x.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        std::fs::write(dir.join("table.bin"), le(&d.table)).unwrap();
        if let Some(s) = &d.slopes {
            let b: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(dir.join("slopes.bin"), b).unwrap();
        }
        let exe = builds.get(&d.dq, &[]);
        super::common::emu::run_exe(&exe, &dir, &d.dq.name());
        let read = |name: &str, shape: &[usize]| {
            let b = std::fs::read(dir.join(name)).unwrap();
            Tensor::from_buffer(from_bytes(&b, q.dtype()), shape).expect("gradient length")
        };
        let g = [
            read("dq.bin", &d.q_shape),
            read("dk.bin", &d.k_shape),
            read("dv.bin", &d.k_shape),
        ];
        let f32s = |name: &str| -> Vec<f32> {
            // An empty call launches nothing and writes no file.
            let b = std::fs::read(dir.join(name)).unwrap_or_default();
            b.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let (lse2, dsum) = (f32s("lse2.bin"), f32s("dsum.bin"));
        let dsink = d.dsink(&lse2, &dsum).map(|x| {
            let n = x.len();
            Tensor::from_buffer(flashattn::Buffer::F32(x), &[n]).unwrap()
        });
        let _ = std::fs::remove_dir_all(&dir);
        (g, dsink)
    }

    /// One batched case: the emulated forward's out and lse (so the scores are recomputed in the
    /// forward's own order, as on a GPU), the emulated backward, the bound.
    fn case<T: Element>(builds: &mut [Builds; 2], c: &GradCase) {
        case_with::<T>(builds, c, &c.opts, false, false);
    }

    /// [`case`] with options of the caller's (a drawn case's, checked with the drawn cases'
    /// bound, `GradData::check_cancel`, when `drawn`); with `sm90`, the backward on bwd_sm90.cu
    /// (`BackwardLaunch::on_sm90`, which must serve the case; `builds[1]` then holds
    /// [`sm90_builds`]).
    pub(crate) fn case_with<T: Element>(
        builds: &mut [Builds; 2],
        c: &GradCase,
        opts: &AttnOptions,
        drawn: bool,
        sm90: bool,
    ) {
        let data = GradData::<T>::new(c);
        let [qt, kt, vt, dt] = data.views();
        let tag = format!("{}_{}", T::DTYPE, c.seed);
        let fd = launch_description(&qt, &kt, &vt, opts).unwrap();
        let fwd = super::run(&mut builds[0], &fd, &qt, &kt, &vt, &tag);
        let fctx = format!("emulated {} seed={} opts={:?}", fd.key.name(), c.seed, opts);
        let r = data.check_forward(&fwd, opts, &fctx);
        let (ov, lv) = (fwd.out.view(), fwd.lse.view());
        let mut desc = backward_launch_description(&qt, &kt, &vt, &ov, &lv, &dt, opts).unwrap();
        if sm90 {
            desc = desc.on_sm90();
            assert!(
                desc.dq.is_sm90() && desc.dkdv.is_sm90(),
                "bwd_sm90.cu does not serve {}",
                desc.dq.name()
            );
        }
        let ([dq, dk, dv], dsink) =
            run(&mut builds[1], &desc, [&qt, &kt, &vt, &ov, &lv, &dt], &tag);
        let ctx = format!(
            "emulated {} seed={} opts={:?}",
            desc.dq.name(),
            c.seed,
            opts
        );
        let expected = data.expected(opts);
        if drawn {
            data.check_cancel([&dq, &dk, &dv], &expected, (opts, &r), &ctx);
        } else {
            data.check([&dq, &dk, &dv], &expected, &ctx);
        }
        match (&dsink, &expected.0.dsink) {
            (Some(got), Some(_)) => data.check_dsink(got, &expected, &r, &ctx),
            (None, None) => assert!(opts.learnable_sink.is_none(), "{ctx}"),
            _ => panic!("{ctx}: dsink present in some results only"),
        }
    }

    /// Learnable sinks through the forward and backward kernels: every third gradient grid case
    /// within a smaller budget (plain, causal, windowed with softcap, ALiBi, dropout, GQA and
    /// MQA), f32 and bf16, with a sink logit per head: out, lse, dq, dk, dv and dsink against
    /// the reference (dsink from the prep kernel's workspaces, as the GPU path computes it).
    #[test]
    fn gradients_with_sinks() {
        if !have_compiler() {
            return;
        }
        let mut builds = [super::forward_builds(), builds()];
        let mut ran = 0;
        let small = cases(true).into_iter().filter(|c| c.cost() <= 3_000_000);
        for (i, c) in small.enumerate().filter(|(i, _)| i % 3 == 0) {
            let heads = c.shape.3;
            let sinks = super::common::test_sinks(heads);
            let opts = c
                .opts
                .clone()
                .learnable_sink(TensorRef::contiguous(&sinks, &[heads]));
            if i % 2 == 0 {
                case_with::<f32>(&mut builds, &c, &opts, false, false);
            } else {
                case_with::<half::bf16>(&mut builds, &c, &opts, false, false);
            }
            ran += 1;
        }
        assert!(ran >= 6, "too few sink cases: {ran}");
    }

    /// The backward property test's drawn cases (`common::backward::drawn`) through fwd.cu and
    /// bwd.cu: any lengths, head dims, masks, softcap, ALiBi, dropout and scales.
    #[test]
    fn drawn_cases() {
        use super::common::backward::drawn;
        use proptest::test_runner::TestRunner;
        if !have_compiler() {
            return;
        }
        let builds = std::cell::RefCell::new([super::forward_builds(), builds()]);
        let mut runner = TestRunner::new(super::common::props::config(12));
        let strategy = (0..3usize, drawn::cases(300_000));
        runner
            .run(&strategy, |(dtype, dr)| {
                let b = &mut builds.borrow_mut();
                let opts = dr.opts();
                match dtype {
                    0 => case_with::<f32>(b, &dr.case, &opts, true, false),
                    1 => case_with::<half::f16>(b, &dr.case, &opts, true, false),
                    _ => case_with::<half::bf16>(b, &dr.case, &opts, true, false),
                }
                Ok(())
            })
            .unwrap();
        let b = builds.borrow();
        eprintln!("{} forward and {} backward builds", b[0].len(), b[1].len());
    }

    /// The CPU gradient grid (dropout included: the kernels regenerate the CPU path's mask), where
    /// a case fits the emulation's budget (all but the 150 x 300 shape with 8 heads); the emulated
    /// forward's out and lse are checked too. With `every_other = Some(r)` (unless
    /// `FLASHATTN_EMU_ALL=1`), only the shaped cases `i % 2 == r` run (the shapes' option sets
    /// alternate) and the huge logits and narrow window cases.
    fn grid<T: Element>(every_other: Option<usize>) {
        if !have_compiler() {
            return;
        }
        let every_other = every_other.filter(|_| !super::common::emu::all());
        let mut builds = [super::forward_builds(), builds()];
        let mut ran = 0;
        let all = cases(true);
        let shaped = all.len() - 2; // the shapes times their option sets, then two more
        for (_, c) in all
            .iter()
            .enumerate()
            .filter(|(i, _)| every_other.is_none_or(|r| i % 2 == r || *i >= shaped))
            .filter(|(_, c)| c.cost() <= 12_000_000)
        {
            case::<T>(&mut builds, c);
            ran += 1;
        }
        let want = if every_other.is_some() { 17 } else { 32 };
        assert_eq!(ran, want, "the emulated gradient grid lost cases");
    }

    #[test]
    fn gradients_f32() {
        grid::<f32>(None);
    }

    /// f16's kernels are bf16's with another element type, so by default the two share the grid:
    /// f16 takes the even cases, bf16 the odd ones (both take the huge logits and narrow window
    /// cases, where f16's range matters).
    #[test]
    fn gradients_f16() {
        grid::<half::f16>(Some(0));
    }

    #[test]
    fn gradients_bf16() {
        grid::<half::bf16>(Some(1));
    }

    /// Packed sequences (one without keys, one without queries, spare query and key rows after
    /// the last sequence, which get zero gradients), with out, dout and lse as strided views; in
    /// f32 (CUDA cores) and bf16 (tensor cores).
    #[test]
    fn varlen_and_strided_views() {
        if !have_compiler() {
            return;
        }
        let mut builds = builds();
        varlen::<f32>(&mut builds, false);
        varlen::<half::bf16>(&mut builds, false);
    }

    /// The packed case of [`varlen_and_strided_views`] in `T`; with `sm90`, on bwd_sm90.cu
    /// (`builds` then [`sm90_builds`]).
    pub(crate) fn varlen<T: Element>(builds: &mut Builds, sm90: bool) {
        let (h, hk, d) = (4usize, 2usize, 24usize);
        let cu_q = [0, 5, 75, 75, 140];
        let cu_k = [0, 0, 90, 120, 200];
        let (tq, tk) = (150usize, 210usize);
        let mut rng = ChaCha8Rng::seed_from_u64(77);
        let mut draw = |n: usize| -> Vec<T> {
            data(&mut rng, n, 1.0)
                .into_iter()
                .map(T::from_f32)
                .collect()
        };
        let q = draw(tq * h * d);
        let k = draw(tk * hk * d);
        let v = draw(tk * hk * d);
        // dout inside a wider buffer: rows of h * (d + pad) elements (a multiple of 8 for
        // bwd_sm90.cu's 16-byte loads).
        let pad = if sm90 { 8 } else { 3 };
        let dout_buf = draw(tq * h * (d + pad));
        let (qt, kt, vt) = (
            TensorRef::contiguous(&q, &[tq, h, d]),
            TensorRef::contiguous(&k, &[tk, hk, d]),
            TensorRef::contiguous(&v, &[tk, hk, d]),
        );
        let dt = TensorRef::new(&dout_buf, &[tq, h, d], &[h * (d + pad), d + pad, 1]);
        for (n, opts) in [AttnOptions::default(), AttnOptions::default().causal(true)]
            .into_iter()
            .enumerate()
        {
            let fwd = flash_attn(&qt, &kt, &vt, &opts.clone().varlen(&cu_q, &cu_k)).unwrap();
            // out as a view with a head stride of d + 5, lse with a head stride of total_q + 7.
            let o = fwd.out.as_slice::<T>().unwrap();
            let mut out_buf = vec![T::from_f32(f32::NAN); tq * h * (d + 5)];
            for (r, row) in o.chunks(d).enumerate() {
                out_buf[r * (d + 5)..r * (d + 5) + d].copy_from_slice(row);
            }
            let ot = TensorRef::new(&out_buf, &[tq, h, d], &[h * (d + 5), d + 5, 1]);
            let l = fwd.lse.as_slice::<f32>().unwrap();
            let mut lse_buf = vec![f32::NAN; h * (tq + 7)];
            for (hh, row) in l.chunks(tq).enumerate() {
                lse_buf[hh * (tq + 7)..hh * (tq + 7) + tq].copy_from_slice(row);
            }
            let lt = TensorRef::new(&lse_buf, &[h, tq], &[tq + 7, 1]);
            let cu = Some((&cu_q[..], &cu_k[..]));
            let mut desc = backward_launch_description(
                &qt,
                &kt,
                &vt,
                &ot,
                &lt,
                &dt,
                &flashattn::AttnOptions {
                    cu_seqlens: cu,
                    ..opts.clone()
                },
            )
            .unwrap();
            if sm90 {
                desc = desc.on_sm90();
                assert!(
                    desc.dq.is_sm90() && desc.dkdv.is_sm90(),
                    "{}",
                    desc.dq.name()
                );
            }
            let ([dq, dk, dv], _) = run(
                builds,
                &desc,
                [&qt, &kt, &vt, &ot, &lt, &dt],
                &format!("varlen{n}_{}{}", T::DTYPE, if sm90 { "_sm90" } else { "" }),
            );
            let want =
                reference::attention_varlen_backward(&qt, &kt, &vt, &dt, &cu_q, &cu_k, &opts)
                    .unwrap();
            let nv = super::common::backward::yardstick(
                &want,
                naive::attention_varlen_backward(&qt, &kt, &vt, &dt, &cu_q, &cu_k, &opts).unwrap(),
                naive::attention_varlen_backward_from_output(
                    &qt, &kt, &vt, &dt, &cu_q, &cu_k, &opts,
                )
                .unwrap(),
            );
            let ctx = format!("emulated varlen {} {opts:?}", desc.dkdv.name());
            check("dq", &dq, &nv.dq, &want.dq, T::DTYPE, &ctx);
            check("dk", &dk, &nv.dk, &want.dk, T::DTYPE, &ctx);
            check("dv", &dv, &nv.dv, &want.dv, T::DTYPE, &ctx);
            // The spare rows after the last sequence: exactly zero.
            let dq = dq.as_slice::<T>().unwrap();
            assert!(dq[140 * h * d..].iter().all(|&x| x.to_f32() == 0.0));
            let dk = dk.as_slice::<T>().unwrap();
            assert!(dk[200 * hk * d..].iter().all(|&x| x.to_f32() == 0.0));
        }
    }
}
