//! Bounds checks: a panic, never an out-of-bounds access.

use super::*;

impl Valid {
    fn new() -> Valid {
        Valid {
            a: vec![1.0; 3 * 8 + 8],
            b: vec![1.0; 7 * 32 + 32],
            c: vec![0.0; 3 * 32 + 32],
        }
    }
    fn gemm(&self) -> Gemm<'_, f32> {
        Gemm {
            m: 4,
            n: 32,
            k: 8,
            a: &self.a,
            a_rs: 8,
            a_cs: 1,
            b: &self.b,
            b_rs: 32,
            accumulate: true,
            kc: KC,
        }
    }
}

/// Each way a product's operands can be too short, on every table (f32 and, where present, bf16).
#[test]
fn gemm_bounds_are_checked_on_every_isa() {
    let tables: Vec<_> = simd::available()
        .into_iter()
        .map(|i| Kernels::for_isa(i).unwrap())
        .collect();
    for kern in tables {
        let v = Valid::new();
        let isa = kern.isa;
        let mut c = v.c.clone();
        kern.gemm(&v.gemm(), &mut c, 32); // the valid call passes
        let run = |what: &str, expected: &str, g: Gemm<'_, f32>, c_len: usize, c_rs: usize| {
            let mut c = vec![0.0; c_len];
            assert_panics(&format!("{isa} gemm: {what}"), expected, || {
                kern.gemm(&g, &mut c, c_rs)
            });
            if kern.has_bf16_dot() {
                let a = vec![0x3F80_3F80u32; g.a.len()];
                let b = vec![0x3F80_3F80u32; g.b.len()];
                let gb = Gemm {
                    a: &a,
                    b: &b,
                    m: g.m,
                    n: g.n,
                    k: g.k,
                    a_rs: g.a_rs,
                    a_cs: g.a_cs,
                    b_rs: g.b_rs,
                    accumulate: g.accumulate,
                    kc: g.kc,
                };
                let mut c = vec![0.0; c_len];
                assert_panics(&format!("{isa} gemm_bf16: {what}"), expected, || {
                    kern.gemm_bf16(&gb, &mut c, c_rs)
                });
            }
        };
        run("C one short", "C too short", v.gemm(), v.c.len() - 1, 32);
        run("c_rs < n", "C too short", v.gemm(), v.c.len(), 16);
        run(
            "A one short",
            "A too short",
            Gemm {
                a: &v.a[..v.a.len() - 1],
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "A transposed, one short",
            "A too short",
            Gemm {
                a_rs: 1,
                a_cs: 4,
                a: &v.a[..7 * 4 + 3],
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "B one short",
            "B too short",
            Gemm {
                b: &v.b[..v.b.len() - 1],
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "b_rs < n",
            "B too short",
            Gemm {
                b_rs: 16,
                ..v.gemm()
            },
            v.c.len(),
            32,
        );
        run(
            "n not padded",
            "not padded",
            Gemm { n: 24, ..v.gemm() },
            v.c.len(),
            32,
        );
        run(
            "kc = 0",
            "kc = 0",
            Gemm { kc: 0, ..v.gemm() },
            v.c.len(),
            32,
        );
    }
}

#[test]
#[should_panic(expected = "C too short")]
fn gemm_panics_on_a_short_c() {
    let v = Valid::new();
    best().gemm(&v.gemm(), &mut v.c.clone()[..v.c.len() - 1], 32);
}

#[test]
#[should_panic(expected = "A too short")]
fn gemm_panics_on_a_short_a() {
    let v = Valid::new();
    best().gemm(
        &Gemm {
            a: &v.a[..v.a.len() - 1],
            ..v.gemm()
        },
        &mut v.c.clone(),
        32,
    );
}

#[test]
#[should_panic(expected = "B too short")]
fn gemm_panics_on_a_short_b() {
    let v = Valid::new();
    best().gemm(
        &Gemm {
            b: &v.b[..v.b.len() - 1],
            ..v.gemm()
        },
        &mut v.c.clone(),
        32,
    );
}

#[test]
#[should_panic(expected = "not padded")]
fn gemm_panics_on_unpadded_n() {
    let v = Valid::new();
    best().gemm(&Gemm { n: 17, ..v.gemm() }, &mut v.c.clone(), 32);
}

#[test]
#[should_panic(expected = "C too short")]
fn gemm_scores_panics_on_a_short_c() {
    let v = Valid::new();
    let mut tmp = v.c.clone();
    best().gemm_scores(&v.gemm(), &mut v.c.clone()[..v.c.len() - 1], 32, &mut tmp);
}

/// A row stride so large that `(m - 1) · c_rs + n` wraps around: the check must still reject it.
/// (In the dev profile overflow checks make the check itself panic; without them the wrapped sum
/// passes and row 1 is written 64 bytes *before* C.)
#[test]
#[should_panic]
fn gemm_check_does_not_wrap_around_on_huge_strides() {
    let b = vec![1.0f32; 16];
    let a = vec![1.0f32; 1];
    let mut buf = vec![SENTINEL; 64];
    let g = Gemm {
        m: 2,
        n: 16,
        k: 1,
        a: &a,
        a_rs: 0,
        a_cs: 1,
        b: &b,
        b_rs: 16,
        accumulate: false,
        kc: KC,
    };
    // Row 1 would land at C - 16 floats, inside `buf`, so no crash hides the outcome.
    best().gemm(&g, &mut buf[32..], usize::MAX - 15);
}

#[test]
fn softmax_bounds_are_checked_on_every_isa() {
    for kern in simd::available()
        .into_iter()
        .map(|i| Kernels::for_isa(i).unwrap())
    {
        let isa = kern.isa;
        let n = 32;
        let v = |len: usize| vec![0f32; len];
        let msg = "assertion failed";
        let (mut rm, mut al, mut ms) = (v(n), v(n), v(n));
        assert_panics(&format!("{isa} max_get_scale: st short"), msg, || {
            kern.max_get_scale(&mut v(2 * n - 1), 2, n, 1.0, &mut rm, &mut al, &mut ms)
        });
        assert_panics(&format!("{isa} max_get_scale: unpadded"), msg, || {
            kern.max_get_scale(
                &mut v(2 * 24),
                2,
                24,
                1.0,
                &mut v(24),
                &mut v(24),
                &mut v(24),
            )
        });
        for short in 0..3 {
            let mut bufs = [v(n), v(n), v(n)];
            bufs[short].pop();
            let [a, b, c] = &mut bufs;
            assert_panics(
                &format!("{isa} max_get_scale: state {short} short"),
                msg,
                || kern.max_get_scale(&mut v(2 * n), 2, n, 1.0, a, b, c),
            );
        }
        assert_panics(&format!("{isa} online_softmax: st short"), msg, || {
            kern.online_softmax(&mut v(3 * n - 1), 3, n, &v(n), &mut v(n), &v(n))
        });
        assert_panics(&format!("{isa} online_softmax: row_sum short"), msg, || {
            kern.online_softmax(&mut v(3 * n), 3, n, &v(n), &mut v(n - 1), &v(n))
        });
        assert_panics(&format!("{isa} online_softmax: alpha short"), msg, || {
            kern.online_softmax(&mut v(3 * n), 3, n, &v(n), &mut v(n), &v(n - 1))
        });
        assert_panics(&format!("{isa} online_softmax: unpadded"), msg, || {
            kern.online_softmax(&mut v(3 * 8), 3, 8, &v(8), &mut v(8), &v(8))
        });
        assert_panics(&format!("{isa} rescale_o: ot short"), msg, || {
            kern.rescale_o(&mut v(4 * n - 1), 4, n, &v(n))
        });
        assert_panics(&format!("{isa} rescale_o: alpha short"), msg, || {
            kern.rescale_o(&mut v(4 * n), 4, n, &v(n - 1))
        });
        assert_panics(&format!("{isa} pack_pairs_bf16: out short"), msg, || {
            kern.pack_pairs_bf16(&v(3 * n), 3, n, &mut vec![0u32; 2 * n - 1])
        });
        assert_panics(&format!("{isa} pack_pairs_bf16: st short"), msg, || {
            kern.pack_pairs_bf16(&v(3 * n - 1), 3, n, &mut vec![0u32; 2 * n])
        });
    }
}

#[test]
#[should_panic(expected = "assertion failed")]
fn online_softmax_panics_on_a_short_st() {
    let n = 16;
    best().online_softmax(
        &mut vec![0.0; 2 * n - 1],
        2,
        n,
        &[0.0; 16],
        &mut [0.0; 16],
        &[1.0; 16],
    );
}

#[test]
#[should_panic(expected = "assertion failed")]
fn rescale_o_panics_on_unpadded_n() {
    best().rescale_o(&mut [0.0; 40], 2, 20, &[1.0; 20]);
}
