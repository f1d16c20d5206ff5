//! decode.cu (append, split, combine) compiled with g++ against `kernels/host_emulation.h` and run
//! with the launches the GPU path would make (`flashattn::cuda::decode_launch_description`), then
//! checked by `check_case_with` exactly as the CPU path: the caches afterwards and the result
//! against the f64 reference. As `cuda::emulated` for the forward: this checks the kernels'
//! indexing, paging, masking, rotary, splits and merge without a GPU, not their speed or the
//! hardware's own behaviour.

use super::*;
use crate::common::emu::{bytes, from_bytes, have_compiler, Builds};
use flashattn::cuda::{
    decode_launch_description, decode_launch_description_fp8, decode_launch_description_with,
    DecodeKernel, DecodeLaunch, GpuShape, KernelKey, KernelKind,
};
use flashattn::fp8::Fp8TensorRef;
use std::process::Command;

const DRIVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/cuda_emu/decode_driver.cpp"
);
const FP8_DRIVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_emu/fp8_driver.cpp");
/// The SM count the automatic split choice assumes (an H100 SXM's).
const SM_COUNT: usize = 132;

/// One binary per split-kernel variant, holding all three decode kernels (FA_DECODE_ENTRY 0).
fn decode_builds() -> Builds {
    Builds::new(DRIVER, &[("FA_DECODE_ENTRY", "0")])
}

/// The launch numbers besides the kernels' parameter (params.bin), in the order
/// decode_driver.cpp reads them.
fn params_text(d: &DecodeLaunch, k_len: usize, v_len: usize) -> String {
    let g = |g: (u32, u32, u32)| [g.0 as i64, g.1 as i64, g.2 as i64];
    let (ws_o, ws_lse) = d.workspace_len();
    let mut n: Vec<i64> = Vec::new();
    n.extend(g(d.split_grid()));
    n.extend(g(d.combine_grid()));
    n.extend(g(d.append_grid()));
    n.extend([
        d.split.smem_bytes() as i64,
        d.append.is_some() as i64,
        d.slopes.is_some() as i64,
        d.rot.is_some() as i64,
        d.out_len as i64,
        d.lse_len as i64,
        ws_o as i64,
        ws_lse as i64,
        k_len as i64,
        v_len as i64,
        d.descale.is_some() as i64,
        d.sink.is_some() as i64,
    ]);
    let t: Vec<String> = n.iter().map(|x| x.to_string()).collect();
    t.join("\n")
}

/// FP8 bytes as the elements of their format.
enum Fp8Elements {
    E4M3(Vec<F8E4M3>),
    E5M2(Vec<F8E5M2>),
}

fn fp8_view<'a>(e: &'a Fp8Elements, map: &CacheMap) -> Fp8TensorRef<'a> {
    match e {
        Fp8Elements::E4M3(x) => Fp8TensorRef::new(x, &map.shape, &map.strides),
        Fp8Elements::E5M2(x) => Fp8TensorRef::new(x, &map.shape, &map.strides),
    }
}

fn fp8_elements(b: &[u8], format: Fp8Format) -> Fp8Elements {
    match format {
        Fp8Format::E4M3 => Fp8Elements::E4M3(b.iter().map(|&x| F8E4M3::from_bits(x)).collect()),
        Fp8Format::E5M2 => Fp8Elements::E5M2(b.iter().map(|&x| F8E5M2::from_bits(x)).collect()),
    }
}

/// One call through the emulated kernels, on copies of the caches (FP8 caches with their
/// factors when the case has them).
fn call(builds: &mut Builds, bl: &Built, c: &DCase, tag: &str) -> CallResult {
    let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
    if let Some(f) = &bl.fp8 {
        return run_fp8(builds, &bl.q_view(c), bl, f, &lens, &bl.opts(c), tag);
    }
    run(builds, &bl.q_view(c), bl, &lens, &bl.opts(c), tag)
}

/// [`call`] through the tensor-core split kernel (the GPU path's default), which the case
/// must allow (f16/bf16, aligned caches): a call that falls back to the CUDA-core kernel fails
/// the test.
fn call_tc(builds: &mut Builds, bl: &Built, c: &DCase, tag: &str) -> CallResult {
    let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
    run_with(
        builds,
        &bl.q_view(c),
        bl,
        &lens,
        &bl.opts(c),
        tag,
        DecodeKernel::TensorCore,
    )
}

/// A call on copies of `f`'s FP8 caches: the launches of
/// `flashattn::cuda::flash_attn_with_kvcache_fp8`, run by the FA_FP8_CACHE build of the
/// kernels; returns the caches afterwards as their raw values (as `Built::call`).
fn run_fp8(
    builds: &mut Builds,
    q: &TensorRef,
    bl: &Built,
    f: &Fp8Caches,
    lens: &[i32],
    opts: &KvCacheOptions,
    tag: &str,
) -> CallResult {
    let descale = Descale::default().k(&f.k_descale).v(&f.v_descale);
    let d = {
        let (k, v) = (fp8_elements(&f.k, f.format), fp8_elements(&f.v, f.format));
        decode_launch_description_fp8(
            q,
            &fp8_view(&k, &bl.map),
            &fp8_view(&v, &bl.map),
            lens,
            &opts.clone().descale(descale),
            SM_COUNT,
        )
    };
    let values = |b: &[u8]| fp8_values(b, f.format);
    let d = match d {
        Ok(d) => d,
        Err(e) => return (Err(e), values(&f.k), values(&f.v)),
    };
    let (res, k, v) = execute(builds, q, &d, opts, (&f.k, &f.v), tag);
    (res, values(&k), values(&v))
}

/// A call with q and options of the caller's making, on copies of `bl`'s caches.
fn run(
    builds: &mut Builds,
    q: &TensorRef,
    bl: &Built,
    lens: &[i32],
    opts: &KvCacheOptions,
    tag: &str,
) -> CallResult {
    run_with(builds, q, bl, lens, opts, tag, DecodeKernel::CudaCore)
}

/// [`run`] with the split kernel `kernel` (the tensor-core one must then be what runs).
fn run_with(
    builds: &mut Builds,
    q: &TensorRef,
    bl: &Built,
    lens: &[i32],
    opts: &KvCacheOptions,
    tag: &str,
    kernel: DecodeKernel,
) -> CallResult {
    let dtype = q.dtype();
    let (kc, vc) = (bl.k_cache.clone(), bl.v_cache.clone());
    let kv = TensorRef::from_slice(kc.as_slice(), &bl.map.shape, &bl.map.strides);
    let vv = TensorRef::from_slice(vc.as_slice(), &bl.map.shape, &bl.map.strides);
    let gpu = GpuShape {
        sm_count: SM_COUNT,
        ..GpuShape::HOPPER
    };
    let d = match decode_launch_description_with(q, &kv, &vv, lens, opts, gpu, kernel) {
        Ok(d) => d,
        Err(e) => return (Err(e), kc, vc),
    };
    if kernel == DecodeKernel::TensorCore {
        assert!(d.split.decode_tc(), "{tag}: not the tensor-core kernel");
    }
    let (kb, vb) = (bytes(kc.as_slice()), bytes(vc.as_slice()));
    let (res, k_after, v_after) = execute(builds, q, &d, opts, (&kb, &vb), tag);
    (
        res,
        from_bytes(&k_after, dtype),
        from_bytes(&v_after, dtype),
    )
}

/// Runs the launches `d` of a call with q, `opts` and caches of these bytes; returns the
/// result and the caches' bytes afterwards.
fn execute(
    builds: &mut Builds,
    q: &TensorRef,
    d: &DecodeLaunch,
    opts: &KvCacheOptions,
    (kb, vb): (&[u8], &[u8]),
    tag: &str,
) -> (flashattn::Result<AttnOutput>, Vec<u8>, Vec<u8>) {
    let dtype = q.dtype();
    let dir = common::emu::case_dir("decode", tag);
    std::fs::create_dir_all(&dir).unwrap();
    let put = |name: &str, b: Vec<u8>| std::fs::write(dir.join(name), b).unwrap();
    // Cache lengths in elements (FP8: one byte each).
    let elem = match (d.descale.is_some(), dtype) {
        (true, _) => 1,
        (false, DType::F32) => 4,
        (false, _) => 2,
    };
    let (k_len, v_len) = (kb.len() / elem, vb.len() / elem);
    put("params.txt", params_text(d, k_len, v_len).into_bytes());
    // The kernels' parameter, byte for byte as a GPU launch passes it (its addresses 0: the
    // driver sets them to its buffers).
    put("params.bin", d.params.as_bytes().to_vec());
    put("q.bin", bytes(q.data()));
    put("k.bin", kb.to_vec());
    put("v.bin", vb.to_vec());
    for (name, t) in [("descale.bin", &d.descale), ("sink.bin", &d.sink)] {
        if let Some(t) = t {
            put(name, t.iter().flat_map(|x| x.to_le_bytes()).collect());
        }
    }
    put(
        "table.bin",
        d.table.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    put(
        "pages.bin",
        d.pages.iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    if let Some((kn, vn)) = &opts.new_kv {
        put("kn.bin", bytes(kn.data()));
        put("vn.bin", bytes(vn.data()));
    }
    if let Some(s) = &d.slopes {
        put(
            "slopes.bin",
            s.iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
    }
    if let Some(r) = &d.rot {
        put("rot.bin", r.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    let exe = builds.get(&d.split, &[]);
    common::emu::run_exe(&exe, &dir, tag);
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let out = from_bytes(&read("out.bin"), dtype);
    let lse = from_bytes(&read("lse.bin"), DType::F32);
    let (k_after, v_after) = (read("k_out.bin"), read("v_out.bin"));
    let _ = std::fs::remove_dir_all(&dir);
    let res = AttnOutput {
        out: Tensor::from_buffer(out, &d.out_shape).expect("out length"),
        lse: Tensor::from_buffer(lse, &d.lse_shape).expect("lse length"),
    };
    (Ok(res), k_after, v_after)
}

/// Per dtype, four variants of the split kernel (head dims 32, 64, 128; masked or not;
/// softcap; ALiBi) over every cache store, appends with and without rotary (both pair
/// layouts), left padding, GQA, MQA and MHA, several query tokens, huge logits and split
/// counts; run under emulation here and on the GPU by `gpu` below.
pub(super) fn kernel_cases(dtype: DType) -> Vec<DCase> {
    vec![
        // The decode benchmark shape in small: 32 heads over 8, d 128, causal, paged, left padding.
        DCase {
            dtype,
            heads: 32,
            heads_kv: 8,
            d: 128,
            cap: 240,
            lens: vec![203],
            leftpad: Some(vec![29]),
            store: Store::Paged(16),
            splits: Some(3),
            seed: 1,
            ..DCase::default()
        },
        // No mask, softcap and ALiBi, rotary (GPT-NeoX pairs), three query tokens, left
        // padding, learnable sinks.
        DCase {
            dtype,
            heads: 6,
            heads_kv: 2,
            d: 59,
            seqlen_q: 3,
            new: Some(3),
            lens: vec![63, 113],
            leftpad: Some(vec![10, 37]),
            cap: 120,
            causal: false,
            softcap: Some(30.0),
            alibi: true,
            rotary: Some((32, false)),
            sink: true,
            seed: 2,
            ..DCase::default()
        },
        // A two-sided window, ALiBi, MQA, interleaved rotary, cache_batch_idx, an empty cache
        // (rows that see no key, with sinks: out 0, lse = the sink).
        DCase {
            dtype,
            heads: 4,
            heads_kv: 1,
            d: 40,
            seqlen_q: 2,
            new: Some(2),
            lens: vec![1, 0, 150],
            cap: 160,
            causal: false,
            window: (5, 2),
            alibi: true,
            rotary: Some((40, true)),
            store: Store::BatchIdx,
            splits: Some(2),
            sink: true,
            seed: 3,
            ..DCase::default()
        },
        // MHA, a left window, strided caches with gaps, no append, huge logits, and a
        // paged cache with pages of 7 rows (split counts below).
        DCase {
            dtype,
            heads: 8,
            heads_kv: 8,
            d: 16,
            new: None,
            lens: vec![90, 17],
            cap: 100,
            causal: false,
            window: (17, -1),
            store: Store::Gaps,
            dist: Dist::Huge(8.0),
            splits: Some(7),
            seed: 4,
            ..DCase::default()
        },
    ]
}

/// [`kernel_cases`], plus split counts 1, 5 and automatic over pages of 7 rows.
#[test]
fn decode_kernels_against_reference() {
    if !have_compiler() {
        return;
    }
    let mut builds = decode_builds();
    let mut n = 0;
    for dtype in DTYPES {
        let cases = kernel_cases(dtype);
        for (i, c) in cases.iter().enumerate() {
            let tag = format!("{dtype}_{i}");
            check_case_with(c, |bl, c| call(&mut builds, bl, c, &tag));
            n += 1;
        }
        // Split counts, automatic included, and a paged cache with small odd pages.
        for (j, splits) in [None, Some(1), Some(5)].into_iter().enumerate() {
            let c = DCase {
                splits,
                store: Store::Paged(7),
                ..cases[0].clone()
            };
            let tag = format!("{dtype}_s{j}");
            check_case_with(&c, |bl, c| call(&mut builds, bl, c, &tag));
            n += 1;
        }
    }
    eprintln!("{n} decode cases emulated, {} kernel builds", builds.len());
}

/// Cases for the tensor-core split kernel (f16/bf16, head_dim and cache strides multiples of
/// 8): [`kernel_cases`] with aligned head dims (64 and 40 padded to 64; 256 on a contiguous
/// cache for the fourth), several row blocks (GQA 8 with 3 query tokens: 24 rows), splits
/// automatic, 1, 5 and more than the keys over pages of 7 rows.
fn tc_cases(dtype: DType) -> Vec<DCase> {
    let mut k = kernel_cases(dtype);
    k[1].d = 64;
    k[3].d = 256;
    k[3].store = Store::Contiguous;
    let mut cases = k.clone();
    cases.push(DCase {
        heads: 16,
        heads_kv: 2,
        seqlen_q: 3,
        new: Some(3),
        d: 96,
        lens: vec![130, 71],
        leftpad: Some(vec![29, 3]),
        cap: 140,
        causal: true,
        softcap: Some(20.0),
        store: Store::Paged(32),
        seed: 5,
        ..k[0].clone()
    });
    for splits in [None, Some(1), Some(5), Some(100)] {
        cases.push(DCase {
            splits,
            store: Store::Paged(7),
            ..k[0].clone()
        });
    }
    cases
}

/// The tensor-core split kernel (decode.cu, DECODE_TC) on [`tc_cases`], checked as every
/// other decode call.
#[test]
fn tensor_core_decode_kernel_against_reference() {
    if !have_compiler() {
        return;
    }
    let mut builds = decode_builds();
    let mut n = 0;
    for dtype in [DType::F16, DType::BF16] {
        for (i, c) in tc_cases(dtype).iter().enumerate() {
            let tag = format!("tc_{dtype}_{i}");
            check_case_with(c, |bl, c| call_tc(&mut builds, bl, c, &tag));
            n += 1;
        }
    }
    eprintln!(
        "{n} tensor-core decode cases emulated, {} kernel builds",
        builds.len()
    );
}

/// [`empty_split_cases`]: more splits than keys, the last ones empty and starting at the end
/// of a full cache.
#[test]
fn empty_splits_at_a_full_cache() {
    if !have_compiler() {
        return;
    }
    let mut builds = decode_builds();
    for dtype in DTYPES {
        for (i, c) in empty_split_cases(dtype).iter().enumerate() {
            let tag = format!("{dtype}_empty{i}");
            check_case_with(c, |bl, c| call(&mut builds, bl, c, &tag));
        }
    }
}

/// The decode property test's draws (`properties::draws`: every option, FP8 caches, any
/// store and split count) through the kernels, checked as on the CPU.
#[test]
fn any_decode_case_on_the_kernels() {
    use proptest::test_runner::TestRunner;
    if !have_compiler() {
        return;
    }
    let builds = std::cell::RefCell::new(decode_builds());
    let mut runner = TestRunner::new(crate::common::props::config(24));
    runner
        .run(&super::properties::draws(), |dr| {
            let c = super::properties::case(&dr);
            check_case_with(&c, |bl, c| call(&mut builds.borrow_mut(), bl, c, "prop"));
            Ok(())
        })
        .unwrap();
    eprintln!("{} kernel builds", builds.borrow().len());
}

/// FP8 caches (`flashattn::cuda::flash_attn_with_kvcache_fp8`'s launches): [`kernel_cases`]
/// with caches in e4m3 and e5m2 and factors per (sequence, kv head), q in every dtype; the
/// same checks as the CPU's FP8 path (appended bytes, untouched bytes, result against the
/// f64 reference on the dequantised caches).
#[test]
fn fp8_decode_kernels_against_reference() {
    if !have_compiler() {
        return;
    }
    let mut builds = decode_builds();
    let mut n = 0;
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for dtype in DTYPES {
            for (i, c) in kernel_cases(dtype).into_iter().enumerate() {
                let c = DCase {
                    fp8: Some(format),
                    ..c
                };
                let tag = format!("{format}_{dtype}_{i}");
                check_case_with(&c, |bl, c| call(&mut builds, bl, c, &tag));
                n += 1;
            }
        }
    }
    eprintln!(
        "{n} FP8 decode cases emulated, {} kernel builds",
        builds.len()
    );
}

/// decode.cu's FP8 conversions against the `float8` crate's: all 256 bytes of each format
/// widened (bit for bit; NaN as NaN), and quantisation (`Fp8Format::quantise`, round to
/// nearest even, saturating) of values around every representable value and midpoint of
/// both formats, subnormals, zeros of both signs, beyond the largest finite value, infinities
/// and NaN.
#[test]
fn fp8_conversions_match_the_cpu() {
    if !have_compiler() {
        return;
    }
    let mut inputs = vec![
        0.0,
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1e-30,
        -1e-30,
        1e30,
        f64::MIN_POSITIVE,
    ];
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let vals = fp8_values(&(0..=255u8).collect::<Vec<_>>(), format);
        let mut v: Vec<f64> = buf_f64(&vals)
            .into_iter()
            .filter(|x| x.is_finite())
            .collect();
        v.sort_by(f64::total_cmp);
        for w in v.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [
                w[0],
                mid,
                w[0] + (mid - w[0]) * 0.999,
                mid + (w[1] - mid) * 1e-3,
            ] {
                inputs.extend([x, -x]);
            }
        }
        let max = format.max() as f64;
        inputs.extend([max * 1.03, max * 1.0625, max * 1.2, -max * 1.07, max * 4.0]);
    }
    let mut rng = common::rng(77);
    inputs.extend((0..2000).map(|_| rng.gen_range(-600.0..600.0f64)));
    // Any FP8 build of decode.cu holds the conversions: the f32 split kernel's.
    let key = KernelKey {
        kind: KernelKind::DecodeSplit,
        fp8: true,
        ..KernelKey::decode_helper(KernelKind::DecodeCombine, DType::F32)
    };
    let mut builds = Builds::new(FP8_DRIVER, &[("FA_DECODE_ENTRY", "0")]);
    let exe = builds.get(&key, &[]);
    let dir = common::emu::case_dir("fp8conv", "");
    std::fs::create_dir_all(&dir).unwrap();
    let raw: Vec<u8> = inputs.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join("in.bin"), raw).unwrap();
    let o = Command::new(&exe)
        .arg(&dir)
        .output()
        .expect("run the driver");
    assert!(o.status.success(), "fp8 driver failed: {o:?}");
    let widened = from_bytes(&std::fs::read(dir.join("widened.bin")).unwrap(), DType::F32);
    let quantised = std::fs::read(dir.join("quantised.bin")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let widened = buf_f64(&widened);
    let n = inputs.len();
    for (f, format) in [Fp8Format::E4M3, Fp8Format::E5M2].into_iter().enumerate() {
        let want = buf_f64(&fp8_values(&(0..=255u8).collect::<Vec<_>>(), format));
        for b in 0..256 {
            let (got, want) = (widened[256 * f + b], want[b]);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{format} byte {b:#04x}: widened to {got}, want {want}"
            );
        }
        for (i, &x) in inputs.iter().enumerate() {
            let (got, want) = (quantised[n * f + i], format.quantise(x));
            let nan = |b: u8| buf_f64(&fp8_values(&[b], format))[0].is_nan();
            assert!(
                got == want || (nan(got) && nan(want)),
                "{format}: {x:e} quantised to {got:#04x}, want {want:#04x}"
            );
        }
    }
    eprintln!("{} values quantised, 512 bytes widened", 2 * n);
}

/// Packed queries of different lengths (`cu_seqlens_q`, two rows after the last sequence)
/// over every cache store, two of them with packed new keys (`cu_seqlens_k_new`): the
/// emulated kernels against the CPU path (itself checked against the reference in
/// `packed_queries_match_per_sequence_calls`), the caches afterwards bit for bit, the rows
/// after the last sequence exactly 0 with lse -inf.
#[test]
fn packed_queries_and_new_keys_match_the_cpu() {
    packed_against_the_cpu(false);
}

/// The same on FP8 caches (e4m3 and e5m2 in turn, q in every dtype, factors per (sequence,
/// kv head)), against the CPU's FP8 path: the caches' bytes afterwards identical.
#[test]
fn fp8_packed_queries_and_new_keys_match_the_cpu() {
    packed_against_the_cpu(true);
}

fn packed_against_the_cpu(fp8: bool) {
    if !have_compiler() {
        return;
    }
    let mut builds = decode_builds();
    let q_lens = [3usize, 0, 1, 6, 2, 4];
    let new_lens = [1usize, 0, 2, 1, 0, 3];
    let total = q_lens.iter().sum::<usize>() + 2;
    let total_new = new_lens.iter().sum::<usize>() + 1;
    let (cu, cu_new) = (cumulative(&q_lens), cumulative(&new_lens));
    let mut n = 0;
    for dtype in DTYPES {
        for mi in 0..4 {
            n += 1;
            let seed = if fp8 { 2900 } else { 1900 } + n as u64;
            let c = DCase {
                fp8: fp8.then_some([Fp8Format::E4M3, Fp8Format::E5M2][n % 2]),
                ..packed_case(dtype, mi, n, seed)
            };
            let bl = build(&c);
            let (h, hkv, d) = (c.heads, c.heads_kv, c.d);
            let mut rng = common::rng(c.seed ^ 0xbeef);
            let qb = to_buffer(&values(&mut rng, total * h * d, Dist::Normal), dtype);
            let knb = to_buffer(&values(&mut rng, total_new * hkv * d, Dist::Normal), dtype);
            let vnb = to_buffer(&values(&mut rng, total_new * hkv * d, Dist::Normal), dtype);
            let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
            let mut opts = bl.opts(&c).cu_seqlens_q(&cu);
            // New keys on the stores whose every row has room (the paged case's block
            // table maps only the pages its cached keys use).
            let appends = mi >= 2;
            if appends {
                opts = opts.cu_seqlens_k_new(&cu_new).new_kv(
                    view_of(&knb, &[total_new, hkv, d]),
                    view_of(&vnb, &[total_new, hkv, d]),
                );
            }
            let q = view_of(&qb, &[total, h, d]);
            let tag = format!("packed_{}{n}", if fp8 { "fp8_" } else { "" });
            // Both paths on copies of the caches; the caches afterwards as values.
            let ((emu, ke, ve), (cpu, kc, vc)) = match &bl.fp8 {
                Some(f) => {
                    let emu = run_fp8(&mut builds, &q, &bl, f, &lens, &opts, &tag);
                    let (mut kc, mut vc) = (f.k.clone(), f.v.clone());
                    let descale = Descale::default().k(&f.k_descale).v(&f.v_descale);
                    let map = (f.format, &bl.map);
                    let cpu = call_fp8(&q, (&mut kc, &mut vc), map, &lens, &descale, &opts);
                    let values = |b: &[u8]| fp8_values(b, f.format);
                    (emu, (cpu, values(&kc), values(&vc)))
                }
                None => {
                    let emu = run(&mut builds, &q, &bl, &lens, &opts, &tag);
                    let (mut kc, mut vc) = (bl.k_cache.clone(), bl.v_cache.clone());
                    let cpu = {
                        let (sh, st) = (&bl.map.shape, &bl.map.strides);
                        let mut k = TensorMut::new(slice_mut(&mut kc), sh, st);
                        let mut v = TensorMut::new(slice_mut(&mut vc), sh, st);
                        flash_attn_with_kvcache(&q, &mut k, &mut v, &lens, &opts)
                    };
                    (emu, (cpu, kc, vc))
                }
            };
            let emu = emu.unwrap_or_else(|e| panic!("{c:?}: {e}"));
            let cpu = cpu.unwrap();
            let what = format!("{c:?} packed, new keys {appends}");
            assert_eq!(buf_bits(&ke), buf_bits(&kc), "{what}: k_cache");
            assert_eq!(buf_bits(&ve), buf_bits(&vc), "{what}: v_cache");
            if appends {
                assert_ne!(
                    buf_bits(&ke),
                    buf_bits(&bl.k_cache),
                    "{what}: nothing appended"
                );
            }
            assert_eq!(emu.out.shape(), cpu.out.shape());
            assert_eq!(emu.lse.shape(), cpu.lse.shape());
            close(&cpu, &emu, dtype, &what);
            let (out, lse) = (emu.out.to_f64_vec(), emu.lse.to_f64_vec());
            assert!(out.iter().all(|x| x.is_finite()), "{what}: NaN in out");
            for r in cu[q_lens.len()] as usize..total {
                assert!(out[r * h * d..(r + 1) * h * d].iter().all(|&x| x == 0.0));
                assert!((0..h).all(|hh| lse[hh * total + r] == f64::NEG_INFINITY));
            }
        }
    }
}

/// The tensor-core split kernel is chosen only when asked for and when the call allows it
/// (f16/bf16, head_dim and both caches' strides multiples of 8), and its automatic split
/// count fills one wave of the CTAs its shared memory lets an SM hold (3 at head_dim 128 on a
/// Hopper's 227 KiB, against 4 of the CUDA-core kernel).
#[test]
fn tensor_core_kernel_choice() {
    let gpu = GpuShape {
        sm_count: 8,
        ..GpuShape::HOPPER
    };
    let describe = |c: &DCase, gpu, kernel| {
        let bl = build(c);
        let kv = TensorRef::from_slice(bl.k_cache.as_slice(), &bl.map.shape, &bl.map.strides);
        let vv = TensorRef::from_slice(bl.v_cache.as_slice(), &bl.map.shape, &bl.map.strides);
        let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
        decode_launch_description_with(&bl.q_view(c), &kv, &vv, &lens, &bl.opts(c), gpu, kernel)
            .unwrap()
    };
    let c = DCase {
        dtype: DType::BF16,
        d: 128,
        lens: vec![4096],
        cap: 4100,
        splits: None,
        ..DCase::default()
    };
    let tc = describe(&c, gpu, DecodeKernel::TensorCore);
    assert!(tc.split.decode_tc());
    assert!(tc.split.name().contains("_tc"), "{}", tc.split.name());
    // 8 SMs x 3 CTAs over 2 kv heads; the CUDA-core kernel 8 x 4.
    assert_eq!(tc.splits, 12);
    let cc = describe(&c, gpu, DecodeKernel::CudaCore);
    assert!(!cc.split.decode_tc());
    assert_eq!(cc.splits, 16);
    // A device whose blocks may have less shared memory than the kernel's 70 KiB at d = 128
    // keeps the CUDA-core kernel.
    let small = GpuShape {
        smem_optin: 64 * 1024,
        ..gpu
    };
    assert!(!describe(&c, small, DecodeKernel::TensorCore)
        .split
        .decode_tc());
    for c in [
        DCase {
            dtype: DType::F32,
            ..c.clone()
        },
        DCase {
            d: 124,
            ..c.clone()
        },
        DCase {
            store: Store::Gaps,
            ..c.clone()
        },
    ] {
        assert!(
            !describe(&c, gpu, DecodeKernel::TensorCore)
                .split
                .decode_tc(),
            "{c:?}"
        );
    }
}

/// Invalid calls are refused before any launch is described (the GPU path validates with the
/// same function, before anything is queued).
#[test]
fn bad_input_is_refused_before_launch() {
    let c = DCase {
        lens: vec![80],
        new: Some(1),
        cap: 80,
        ..DCase::default()
    };
    let bl = build(&c);
    let kv = TensorRef::from_slice(bl.k_cache.as_slice(), &bl.map.shape, &bl.map.strides);
    let vv = TensorRef::from_slice(bl.v_cache.as_slice(), &bl.map.shape, &bl.map.strides);
    let err =
        decode_launch_description(&bl.q_view(&c), &kv, &vv, &[80], &bl.opts(&c), 132).unwrap_err();
    assert_kind!(err.kind(), ErrorKind::CacheOverflow { .. });
    let c = DCase {
        splits: Some(flashattn::decode::MAX_NUM_SPLITS + 1),
        ..DCase::default()
    };
    let bl = build(&c);
    let kv = TensorRef::from_slice(bl.k_cache.as_slice(), &bl.map.shape, &bl.map.strides);
    let vv = TensorRef::from_slice(bl.v_cache.as_slice(), &bl.map.shape, &bl.map.strides);
    let err =
        decode_launch_description(&bl.q_view(&c), &kv, &vv, &[50], &bl.opts(&c), 132).unwrap_err();
    assert_kind!(err.kind(), ErrorKind::NumSplits { num_splits: 257 });
    // FP8 caches: the CPU's FP8 checks, before any launch is described.
    let c = DCase {
        fp8: Some(Fp8Format::E4M3),
        ..DCase::default()
    };
    let bl = build(&c);
    let f = bl.fp8.as_ref().unwrap();
    let (k4, v4) = (fp8_elements(&f.k, f.format), fp8_elements(&f.v, f.format));
    let v5 = fp8_elements(&f.v, Fp8Format::E5M2);
    let lens: Vec<i32> = c.lens.iter().map(|&x| x as i32).collect();
    let (q, opts, map) = (bl.q_view(&c), bl.opts(&c), &bl.map);
    let describe = |v: &Fp8Elements, d: &Descale| {
        let (k, v) = (fp8_view(&k4, map), fp8_view(v, map));
        decode_launch_description_fp8(&q, &k, &v, &lens, &opts.clone().descale(*d), 132)
    };
    let good = Descale::default().k(&f.k_descale).v(&f.v_descale);
    let err = describe(&v5, &good).unwrap_err();
    assert_kind!(err.kind(), ErrorKind::Fp8CacheFormat { .. });
    let err = describe(&v4, &good.q(&[1.0])).unwrap_err();
    assert_kind!(err.kind(), ErrorKind::DescaleUnused { .. });
    let err = describe(&v4, &Descale::default().k(&[1.0, 2.0, 3.0])).unwrap_err();
    assert_kind!(err.kind(), ErrorKind::DescaleLength { .. });
    let err = describe(&v4, &Descale::default().v(&[f32::NAN])).unwrap_err();
    assert_kind!(err.kind(), ErrorKind::DescaleValue { .. });
    assert!(describe(&v4, &good).is_ok());
}
