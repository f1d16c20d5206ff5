//! The checks of one decode case: the caches afterwards, out and lse against the f64 reference.

use super::*;

/// Runs a case and checks the caches and the result; returns the result.
pub(super) fn check_case(c: &DCase) -> AttnOutput {
    check_case_with(c, |bl, c| bl.call(c))
}

/// What runs a call: the result and the caches afterwards.
pub(super) type CallResult = (flashattn::Result<AttnOutput>, Buffer, Buffer);

/// [`check_case`] with the call made by `call` (the CPU path, or the CUDA kernels under host
/// emulation).
pub(super) fn check_case_with(
    c: &DCase,
    mut call: impl FnMut(&Built, &DCase) -> CallResult,
) -> AttnOutput {
    let bl = build(c);
    let (res, kc_after, vc_after) = call(&bl, c);
    let flash = res.unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let (batch, sq, h, hkv, d) = (c.batch(), c.seqlen_q, c.heads, c.heads_kv, c.d);
    let eps = c.dtype.epsilon();

    // The caches afterwards.
    let (k_before, v_before) = (buf_bits(&bl.k_cache), buf_bits(&bl.v_cache));
    let (k_bits, v_bits) = (buf_bits(&kc_after), buf_bits(&vc_after));
    let (k_after, v_after) = (buf_f64(&kc_after), buf_f64(&vc_after));
    let mut written = vec![false; bl.map.len];
    let half = c.rotary.map_or(0, |r| r.0 / 2);
    let (k_new, v_new) = match (&bl.k_new, &bl.v_new) {
        (Some(k), Some(v)) => (buf_f64(&k.1), buf_f64(&v.1)),
        _ => (Vec::new(), Vec::new()),
    };
    for b in 0..batch {
        for t in 0..c.seqlen_new() {
            let pos = c.lens[b] + t;
            for hk in 0..hkv {
                let o = bl.map.offset(b, pos, hk);
                let src = ((b * c.seqlen_new() + t) * hkv + hk) * d;
                let (dk, dv) = bl.descale(b, hk, c);
                // k_new as stored (rounded to the dtype), rotated here in f64.
                let orig = k_new[src..src + d].to_vec();
                let mut want = orig.clone();
                if let (Some((cos, sin)), Some((_, inter))) = (&bl.cos_sin, c.rotary) {
                    rotate_f64(&mut want, cos, sin, half, pos, inter);
                }
                for x in 0..d {
                    written[o + x] = true;
                    if let Some(f) = &bl.fp8 {
                        // Rounded once to FP8 from want / k_descale (the kernel rotates in f32,
                        // so a value within ~1e-7 of a midpoint may go either way).
                        let (w, got) = (want[x] / dk, k_after[o + x]);
                        let best = buf_f64(&fp8_values(&[f.format.quantise(w)], f.format))[0];
                        assert!(
                            got == best || ((got - w).abs() - (best - w).abs()).abs() <= 1e-6 * w.abs(),
                            "{c:?}: k_cache (b {b}, pos {pos}, hk {hk}, {x}) = {got}, want {best} ({w})"
                        );
                        let vq = f.format.quantise(v_new[src + x] / dv);
                        assert_eq!(
                            v_after[o + x].to_bits(),
                            buf_f64(&fp8_values(&[vq], f.format))[0].to_bits(),
                            "{c:?}: v_cache (b {b}, pos {pos}, hk {hk}, {x})"
                        );
                        continue;
                    }
                    let pair = if half == 0 || x >= 2 * half {
                        orig[x].abs()
                    } else {
                        orig.iter().take(2 * half).fold(0f64, |m, y| m.max(y.abs()))
                    };
                    let tol = 4.0 * eps * pair * 2.0;
                    assert!(
                        (k_after[o + x] - want[x]).abs() <= tol,
                        "{c:?}: k_cache (b {b}, pos {pos}, hk {hk}, {x}) = {}, want {} (tol {tol:e})",
                        k_after[o + x],
                        want[x]
                    );
                    assert_eq!(
                        v_after[o + x],
                        v_new[src + x],
                        "{c:?}: v_cache (b {b}, pos {pos})"
                    );
                }
            }
        }
    }
    for i in 0..bl.map.len {
        if !written[i] {
            assert_eq!(k_bits[i], k_before[i], "{c:?}: k_cache[{i}] changed");
            assert_eq!(v_bits[i], v_before[i], "{c:?}: v_cache[{i}] changed");
        }
    }

    // The equivalent plain attention, per sequence.
    let half = c.rotary.map_or(0, |r| r.0 / 2);
    let mut ref_out = vec![0f64; batch * sq * h * d];
    let mut ref_lse = vec![0f64; batch * h * sq];
    let mut naive_out = [
        vec![0f64; batch * sq * h * d],
        vec![0f64; batch * sq * h * d],
    ];
    let mut naive_lse = [vec![0f64; batch * h * sq], vec![0f64; batch * h * sq]];
    let mut v_max = 0f64;
    let mut max_keys = 0;
    let q_stored = buf_f64(&bl.qb);
    for b in 0..batch {
        // cache_leftpad: the keys before c.first_key(b) do not exist for the oracle, which
        // aligns its masks to the sk keys that remain.
        let (lp, sk) = (c.first_key(b), c.seqlen_k(b) - c.first_key(b));
        max_keys = max_keys.max(sk);
        let mut qb = q_stored[b * sq * h * d..(b + 1) * sq * h * d].to_vec();
        if let (Some((cos, sin)), Some((_, inter))) = (&bl.cos_sin, c.rotary) {
            for i in 0..sq {
                for hh in 0..h {
                    let o = (i * h + hh) * d;
                    // flash-attn's rule: query i at cache_seqlens[b] + i under a causal or
                    // windowed mask, every query at cache_seqlens[b] without one.
                    let masked = c.causal || c.window != (-1, -1);
                    let pos = c.lens[b] + if masked { i } else { 0 };
                    rotate_f64(&mut qb[o..o + d], cos, sin, half, pos, inter);
                }
            }
            // The rotated q in q's dtype, rounded once from f64: flash-attn's contract (its
            // rotary embedding hands q over in its dtype), which flashattn follows on every
            // instruction set. With logits of ~30 the unrounded q moved the oracle 0.05 away
            // from a bf16 result that rounds it (a property-test draw, seed 23, 10000 cases).
            qb = buf_f64(&to_buffer(&qb, c.dtype));
        }
        let mut kb = Vec::with_capacity(sk * hkv * d);
        let mut vb = Vec::with_capacity(sk * hkv * d);
        for j in lp..lp + sk {
            for hk in 0..hkv {
                let o = bl.map.offset(b, j, hk);
                // FP8: the raw values times their factors (exact in f64).
                let (dk, dv) = bl.descale(b, hk, c);
                kb.extend(k_after[o..o + d].iter().map(|&x| x * dk));
                vb.extend(v_after[o..o + d].iter().map(|&x| x * dv));
            }
        }
        v_max = vb.iter().fold(v_max, |m, x| m.max(x.abs()));
        let (qs, ks) = ([1, sq, h, d], [1, sk, hkv, d]);
        let slopes = &bl.alibi[b * h..(b + 1) * h];
        let mut o = AttnOptions::default()
            .causal(c.causal)
            .window(c.window.0, c.window.1);
        o.softcap = c.softcap;
        if c.alibi {
            o = o.alibi_slopes(TensorRef::contiguous(slopes, &[h]));
        }
        if c.sink {
            o = o.learnable_sink(TensorRef::contiguous(&bl.sinks, &[h]));
        }
        // The oracle sees exact values: the rotated q and FP8 values times their factors in
        // f64 (rounded to f32 they would carry an error as large as f32 attention's own); naive
        // sees them rounded to the dtype, as a framework would.
        let r = reference::attention_f64((&qb, &qs), (&kb, &ks), (&vb, &ks), &o)
            .unwrap_or_else(|e| panic!("{c:?}: reference: {e}"));
        let (qn, kn, vn) = (
            to_buffer(&qb, c.dtype),
            to_buffer(&kb, c.dtype),
            to_buffer(&vb, c.dtype),
        );

        for (n, order) in [DotOrder::Lanes8, DotOrder::Sequential]
            .into_iter()
            .enumerate()
        {
            let nv = naive::attention_with_order(
                &view_of(&qn, &qs),
                &view_of(&kn, &ks),
                &view_of(&vn, &ks),
                &o,
                order,
            )
            .unwrap();
            naive_out[n][b * sq * h * d..(b + 1) * sq * h * d]
                .copy_from_slice(&nv.out.to_f64_vec());
            naive_lse[n][b * h * sq..(b + 1) * h * sq].copy_from_slice(&nv.lse.to_f64_vec());
        }
        ref_out[b * sq * h * d..(b + 1) * sq * h * d].copy_from_slice(&r.out);
        ref_lse[b * h * sq..(b + 1) * h * sq].copy_from_slice(&r.lse);
    }
    let out_shape = vec![batch, sq, h, d];
    let lse_shape = vec![batch, h, sq];
    let r = Reference {
        out: ref_out,
        lse: ref_lse,
        out_shape: out_shape.clone(),
        lse_shape: lse_shape.clone(),
    };
    let naives: Vec<AttnOutput> = (0..2)
        .map(|n| AttnOutput {
            out: Tensor::from_buffer(to_buffer(&naive_out[n], c.dtype), &out_shape).unwrap(),
            lse: Tensor::from_buffer(
                Buffer::F32(naive_lse[n].iter().map(|&x| x as f32).collect()),
                &lse_shape,
            )
            .unwrap(),
        })
        .collect();
    check_bound(
        &format!("{c:?}"),
        c.dtype,
        &flash,
        &naives,
        &r,
        v_max,
        max_keys,
    );
    flash
}
