//! Bad input of every kind is a typed error that leaves the caches bit-identical.

use super::*;

/// The pieces of a call, each replaceable by a bad one.
struct Call<'a> {
    q: TensorRef<'a>,
    lens: Vec<i32>,
    opts: KvCacheOptions<'a>,
    k_shape: Vec<usize>,
    k_strides: Vec<usize>,
    v_shape: Vec<usize>,
    /// Use an f16 v_cache instead of the case's dtype.
    v_f16: bool,
}

/// The valid call of case `c` as a [`Call`], for the checks to break one thing of.
fn base_call<'a>(bl: &'a Built, c: &DCase) -> Call<'a> {
    Call {
        q: bl.q_view(c),
        lens: c.lens.iter().map(|&x| x as i32).collect(),
        opts: bl.opts(c),
        k_shape: bl.map.shape.clone(),
        k_strides: bl.map.strides.clone(),
        v_shape: bl.map.shape.clone(),
        v_f16: false,
    }
}

/// A q whose `out` no machine can hold (a stride-0 view of 2^51 rows: 2^60 bytes of out) is
/// `OutOfMemory`, and the append it carries has written nothing: the results are allocated
/// before the caches are written.
#[test]
fn results_too_large_to_allocate_write_nothing() {
    let c = DCase {
        lens: vec![10, 20],
        new: Some(2),
        seqlen_q: 2,
        cap: 32,
        causal: false,
        store: Store::Paged(8),
        ..DCase::default()
    };
    let bl = build(&c);
    assert!(bl.call(&c).0.is_ok(), "the base case is valid");
    let rows = 1usize << 51;
    let q = TensorRef::from_slice(bl.qb.as_slice(), &[2, rows, c.heads, c.d], &[0, 0, c.d, 1]);
    let e = expect_err(
        &bl,
        Call {
            q,
            ..base_call(&bl, &c)
        },
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::OutOfMemory {
            what: "`out`",
            bytes: 2 * rows * c.heads * c.d * 4
        }
    );
}

/// Runs a bad call on copies of the caches: it must return an error (not panic), and leave both
/// caches bit-identical.
fn expect_err(bl: &Built, call: Call) -> Error {
    let (mut kc, mut vc) = (bl.k_cache.clone(), bl.v_cache.clone());
    let mut vc16 = Buffer::F16(vec![half::f16::ZERO; bl.map.len]);
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut k = TensorMut::new(slice_mut(&mut kc), &call.k_shape, &call.k_strides);
        let vbuf = if call.v_f16 { &mut vc16 } else { &mut vc };
        let v_strides = flashattn::tensor::contiguous_strides(&call.v_shape);
        let mut v = TensorMut::new(slice_mut(vbuf), &call.v_shape, &v_strides);
        flash_attn_with_kvcache(&call.q, &mut k, &mut v, &call.lens, &call.opts)
    }));
    let err = match res {
        Ok(Err(e)) => e,
        Ok(Ok(_)) => panic!("accepted an invalid input"),
        Err(_) => panic!("panicked instead of returning an error"),
    };
    assert_eq!(
        buf_bits(&kc),
        buf_bits(&bl.k_cache),
        "k_cache changed by a rejected call"
    );
    assert_eq!(
        buf_bits(&vc),
        buf_bits(&bl.v_cache),
        "v_cache changed by a rejected call"
    );
    err
}

#[test]
fn bad_input_is_a_typed_error_and_writes_nothing() {
    // A valid paged case with new keys and rotary; each check below breaks one thing.
    let c = DCase {
        lens: vec![10, 20],
        new: Some(2),
        seqlen_q: 2,
        cap: 32,
        rotary: Some((8, false)),
        store: Store::Paged(8),
        ..DCase::default()
    };
    let bl = build(&c);
    assert!(bl.call(&c).0.is_ok(), "the base case is valid");
    let base = || base_call(&bl, &c);
    let kind = |call: Call| expect_err(&bl, call).kind().clone();

    // Appending past the pages a sequence owns: 20 + 2 > 2 blocks · 8? No: max_blocks = 4 (32 /
    // 8), so 31 + 2 = 33 > 32 overflows.
    let e = expect_err(
        &bl,
        Call {
            lens: vec![10, 31],
            ..base()
        },
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::CacheOverflow {
            batch: 1,
            cache_seqlen: 31,
            seqlen_new: 2,
            needed: 33,
            capacity: 32
        }
    );
    assert!(e.to_string().contains("nothing was written"), "{e}");
    assert_eq!(
        kind(Call {
            lens: vec![-1, 20],
            ..base()
        }),
        ErrorKind::IndexOutOfRange {
            tensor: "cache_seqlens",
            index: 0,
            value: -1,
            bound: i32::MAX as usize
        }
    );
    assert!(matches!(
        kind(Call {
            lens: vec![10],
            ..base()
        }),
        ErrorKind::IndexLength {
            tensor: "cache_seqlens",
            expected: 2,
            got: 1,
            ..
        }
    ));
    // A q with no elements and a batch of usize::MAX (a property-test draw, seed 51: it
    // panicked with a capacity overflow where the batch sized the sequence table).
    let no_q: Vec<f32> = Vec::new();
    assert!(matches!(
        kind(Call {
            q: TensorRef::contiguous(&no_q, &[usize::MAX, 0, 4, 16]),
            ..base()
        }),
        ErrorKind::IndexLength {
            tensor: "cache_seqlens",
            expected: usize::MAX,
            got: 2,
            ..
        }
    ));
    // Block table: an out-of-range and a negative entry among the used ones; wrong size.
    let mut table = bl.map.table.clone();
    table[1] = 1000;
    let n_blocks = bl.map.shape[0];
    assert_eq!(
        kind(Call {
            opts: bl.opts(&c).block_table(BlockTable::new(&table, 2, 4)),
            ..base()
        }),
        ErrorKind::IndexOutOfRange {
            tensor: "block_table",
            index: 1,
            value: 1000,
            bound: n_blocks
        }
    );
    let mut table = bl.map.table.clone();
    table[4] = -5;
    assert!(matches!(
        kind(Call {
            opts: bl.opts(&c).block_table(BlockTable::new(&table, 2, 4)),
            ..base()
        }),
        ErrorKind::IndexOutOfRange {
            tensor: "block_table",
            index: 4,
            value: -5,
            ..
        }
    ));
    assert!(matches!(
        kind(Call {
            opts: bl
                .opts(&c)
                .block_table(BlockTable::new(&bl.map.table[..7], 2, 4)),
            ..base()
        }),
        ErrorKind::IndexLength {
            tensor: "block_table",
            expected: 8,
            got: 7,
            ..
        }
    ));
    let idx = [0, 1];
    assert_eq!(
        kind(Call {
            opts: bl.opts(&c).cache_batch_idx(&idx),
            ..base()
        }),
        ErrorKind::PagedWithBatchIdx
    );
    // New keys: shape, dtype.
    let (kb, vb) = (&bl.k_new.as_ref().unwrap().1, &bl.v_new.as_ref().unwrap().1);
    let bad_shape = [2, 2, 2, 15];

    assert_kind!(
        kind(Call {
            opts: bl.opts(&c).new_kv(
                TensorRef::from_slice(kb.as_slice(), &bad_shape, &[64, 32, 16, 1]),
                view_of(vb, &[2, 2, 2, 16]),
            ),
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "k_new",
            ..
        }
    );
    let v16 = vec![half::f16::ONE; 128];
    assert_kind!(
        kind(Call {
            opts: bl.opts(&c).new_kv(
                view_of(kb, &[2, 2, 2, 16]),
                TensorRef::contiguous(&v16, &[2, 2, 2, 16]),
            ),
            ..base()
        }),
        ErrorKind::DType {
            tensor: "v_new",
            ..
        }
    );
    // Caches: dtype and shape.
    assert_kind!(
        kind(Call {
            v_f16: true,
            ..base()
        }),
        ErrorKind::DType {
            tensor: "v_cache",
            ..
        }
    );
    let mut vs = bl.map.shape.clone();
    vs[0] -= 1;
    assert_kind!(
        kind(Call {
            v_shape: vs,
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "v_cache",
            ..
        }
    );
    // k_cache strides that reach past the buffer.
    let mut ks = bl.map.strides.clone();
    ks[0] += 1;
    assert_kind!(
        kind(Call {
            k_strides: ks,
            ..base()
        }),
        ErrorKind::OutOfBounds {
            tensor: "k_cache",
            ..
        }
    );
    // Rotary: without new keys, too wide, too few positions.
    let mut o = bl.opts(&c);
    o.new_kv = None;
    assert_eq!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::RotaryWithoutNewKv
    );
    let wide = vec![0.5f32; 64 * 9];
    let e = kind(Call {
        opts: bl.opts(&c).rotary(
            TensorRef::contiguous(&wide, &[64, 9]),
            TensorRef::contiguous(&wide, &[64, 9]),
            false,
        ),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::RotaryDim {
            rotary_dim: 18,
            head_dim: 16
        }
    );
    // A table of no rows and usize::MAX columns: `2 · half` overflowed in the check (a panic
    // with overflow checks on; found by `properties::changed_calls_fail_cleanly`).
    let e = kind(Call {
        opts: bl.opts(&c).rotary(
            TensorRef::contiguous(&wide[..0], &[0, usize::MAX]),
            TensorRef::contiguous(&wide[..0], &[0, usize::MAX]),
            false,
        ),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::RotaryDim {
            rotary_dim: usize::MAX,
            head_dim: 16
        }
    );
    let short = vec![0.5f32; 21 * 4];
    let e = kind(Call {
        opts: bl.opts(&c).rotary(
            TensorRef::contiguous(&short, &[21, 4]),
            TensorRef::contiguous(&short, &[21, 4]),
            false,
        ),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::RotaryPositions {
            batch: 1,
            needed: 22,
            seqlen_ro: 21
        }
    );
    assert_kind!(
        kind(Call {
            opts: bl.opts(&c).rotary(
                TensorRef::contiguous(&short, &[21, 4]),
                TensorRef::contiguous(&short[..20 * 4], &[20, 4]),
                false,
            ),
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "rotary_sin",
            ..
        }
    );
    // Options.
    assert_eq!(
        kind(Call {
            opts: bl.opts(&c).num_splits(0),
            ..base()
        }),
        ErrorKind::NumSplits { num_splits: 0 }
    );
    // More splits than any call may ask for: refused before anything is allocated (2^31 splits
    // tried to allocate 80 GB of partial results; found by `changed_calls_fail_cleanly`).
    for n in [flashattn::decode::MAX_NUM_SPLITS + 1, 1 << 31, usize::MAX] {
        assert_eq!(
            kind(Call {
                opts: bl.opts(&c).num_splits(n),
                ..base()
            }),
            ErrorKind::NumSplits { num_splits: n }
        );
    }
    let mut o = bl.opts(&c);
    o.attn = o.attn.dropout(0.1, 1);
    assert_eq!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::DropoutInDecode { p: 0.1 }
    );
    let mut o = bl.opts(&c);
    o.attn = o.attn.window(-3, 0);
    assert_eq!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::Window { left: -3, right: 0 }
    );
    let bad_slopes = [0.1f32; 3];
    let mut o = bl.opts(&c);
    o.attn = o
        .attn
        .alibi_slopes(TensorRef::contiguous(&bad_slopes, &[3]));
    assert!(matches!(
        kind(Call { opts: o, ..base() }),
        ErrorKind::AlibiShape { .. }
    ));
    // A slope whose bias overflows at the farthest key: sequence 1 attends 20 + 2 keys, so the
    // distance reaches 21 (slope · log2(e) · 21 overflows from |slope| ≈ 1.12e37 on).
    for bad in [-1.2e37f32, 1.2e37, f32::NAN] {
        let slopes = [0.1f32, 0.2, bad, 0.3];
        let mut o = bl.opts(&c);
        o.attn = o.attn.alibi_slopes(TensorRef::contiguous(&slopes, &[4]));
        assert_eq!(
            format!("{:?}", kind(Call { opts: o, ..base() })),
            format!(
                "{:?}",
                ErrorKind::AlibiSlope {
                    batch: 0,
                    head: 2,
                    slope: bad,
                    max_distance: 21
                }
            )
        );
    }
    // q: heads not a multiple of heads_kv, head_dim mismatch.
    let q3 = vec![0.5f32; 2 * 2 * 3 * 16];
    let e = kind(Call {
        q: TensorRef::contiguous(&q3, &[2, 2, 3, 16]),
        ..base()
    });
    assert_eq!(
        e,
        ErrorKind::HeadsNotMultiple {
            heads: 3,
            heads_kv: 2
        }
    );
    let q8 = vec![0.5f32; 2 * 2 * 4 * 8];
    assert_kind!(
        kind(Call {
            q: TensorRef::contiguous(&q8, &[2, 2, 4, 8]),
            ..base()
        }),
        ErrorKind::Shape {
            tensor: "k_cache",
            ..
        }
    );

    // Contiguous cache: cache_batch_idx out of range and of the wrong length; batch mismatch.
    let c2 = DCase {
        lens: vec![3, 4],
        cap: 8,
        store: Store::BatchIdx,
        ..DCase::default()
    };
    let bl2 = build(&c2);
    let base2 = || base_call(&bl2, &c2);
    let idx = [0, 4];
    assert_eq!(
        expect_err(
            &bl2,
            Call {
                opts: bl2.opts(&c2).cache_batch_idx(&idx),
                ..base2()
            }
        )
        .kind(),
        &ErrorKind::IndexOutOfRange {
            tensor: "cache_batch_idx",
            index: 1,
            value: 4,
            bound: 4
        }
    );
    let idx = [0];
    assert!(matches!(
        expect_err(
            &bl2,
            Call {
                opts: bl2.opts(&c2).cache_batch_idx(&idx),
                ..base2()
            }
        )
        .kind(),
        ErrorKind::IndexLength {
            tensor: "cache_batch_idx",
            ..
        }
    ));
    // cache_leftpad past its sequence's cache, negative, of the wrong length.
    for (lp, want) in [
        (
            &[0, 5][..],
            ErrorKind::IndexOutOfRange {
                tensor: "cache_leftpad",
                index: 1,
                value: 5,
                bound: 5,
            },
        ),
        (
            &[-1, 0][..],
            ErrorKind::IndexOutOfRange {
                tensor: "cache_leftpad",
                index: 0,
                value: -1,
                bound: 4,
            },
        ),
        (
            &[0][..],
            ErrorKind::IndexLength {
                tensor: "cache_leftpad",
                expected: 2,
                got: 1,
                what: "one per batch row of q",
            },
        ),
    ] {
        let call = Call {
            opts: bl2.opts(&c2).cache_leftpad(lp),
            ..base2()
        };
        assert_eq!(expect_err(&bl2, call).kind(), &want, "cache_leftpad {lp:?}");
    }
    // Packed queries (cu_seqlens_q): q [total_q, heads, d] with 3 rows for the batch of 2.
    let q3 = to_buffer(&vec![0.25; 3 * c2.heads * c2.d], c2.dtype);
    let q3v = || view_of(&q3, &[3, c2.heads, c2.d]);
    let no_new = || {
        let mut o = bl2.opts(&c2);
        o.new_kv = None;
        o
    };
    let packed_err = |q: TensorRef, cu: &[i32], opts: KvCacheOptions| {
        let opts = opts.cu_seqlens_q(cu);
        expect_err(&bl2, Call { q, opts, ..base2() }).kind().clone()
    };
    assert_kind!(
        packed_err(q3v(), &[0, 2, 1], no_new()),
        ErrorKind::CuSeqlens {
            tensor: "cu_seqlens_q",
            ..
        }
    );
    assert_kind!(
        packed_err(q3v(), &[0, 2, 4], no_new()),
        ErrorKind::CuSeqlens {
            tensor: "cu_seqlens_q",
            ..
        }
    );
    assert_kind!(
        packed_err(q3v(), &[0, 1, 2, 3], no_new()),
        ErrorKind::IndexLength {
            tensor: "cache_seqlens",
            ..
        }
    );
    assert_kind!(
        packed_err(bl2.q_view(&c2), &[0, 1, 2], no_new()),
        ErrorKind::Rank {
            tensor: "q",
            expected: 3,
            ..
        }
    );
    // Packed new keys (cu_seqlens_k_new): k_new/v_new [6, heads_kv, d] for the batch of 2.
    let kv6 = to_buffer(&vec![0.5; 6 * c2.heads_kv * c2.d], c2.dtype);
    let kv5 = to_buffer(&vec![0.5; 5 * c2.heads_kv * c2.d], c2.dtype);
    let packed_new = |rows: usize, v_rows: usize| {
        let (k, v) = (
            if rows == 6 { &kv6 } else { &kv5 },
            if v_rows == 6 { &kv6 } else { &kv5 },
        );
        bl2.opts(&c2).new_kv(
            view_of(k, &[rows, c2.heads_kv, c2.d]),
            view_of(v, &[v_rows, c2.heads_kv, c2.d]),
        )
    };
    let new_err = |cu: &[i32], opts: KvCacheOptions| {
        let opts = opts.cu_seqlens_k_new(cu);
        expect_err(&bl2, Call { opts, ..base2() }).kind().clone()
    };
    assert_eq!(
        new_err(&[0, 1, 2], no_new()),
        ErrorKind::CuSeqlensKNewWithoutNewKv
    );
    // The batched layout with cu_seqlens_k_new.
    assert_kind!(
        new_err(&[0, 1, 2], bl2.opts(&c2)),
        ErrorKind::Rank {
            tensor: "k_new",
            expected: 3,
            ..
        }
    );
    for cu in [
        &[0, 2][..],
        &[0, 2, 4, 6],
        &[1, 2, 4],
        &[0, 4, 2],
        &[0, 2, 7],
    ] {
        assert_kind!(
            new_err(cu, packed_new(6, 6)),
            ErrorKind::CuSeqlens {
                tensor: "cu_seqlens_k_new",
                ..
            }
        );
    }
    assert_kind!(
        new_err(&[0, 2, 5], packed_new(6, 5)),
        ErrorKind::Shape {
            tensor: "v_new",
            ..
        }
    );
    // Sequence 1 (4 cached of 8) cannot take 5 more; sequence 0 (3 cached) could take its 1:
    // nothing is written for either.
    assert_eq!(
        new_err(&[0, 1, 6], packed_new(6, 6)),
        ErrorKind::CacheOverflow {
            batch: 1,
            cache_seqlen: 4,
            seqlen_new: 5,
            needed: 9,
            capacity: 8
        }
    );
    let mut o = bl2.opts(&c2);
    o.cache_batch_idx = None; // 4 cache rows for a batch of 2, and no map
    assert!(matches!(
        expect_err(&bl2, Call { opts: o, ..base2() }).kind(),
        ErrorKind::Shape {
            tensor: "k_cache",
            ..
        }
    ));
    let e = expect_err(
        &bl2,
        Call {
            lens: vec![3, 8],
            ..base2()
        },
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::CacheOverflow {
            batch: 1,
            cache_seqlen: 8,
            seqlen_new: 1,
            needed: 9,
            capacity: 8
        }
    );
}

/// Every message names the offending tensor or option.
#[test]
fn messages_name_the_problem() {
    let cases: Vec<(ErrorKind, &str)> = vec![
        (
            ErrorKind::IndexOutOfRange {
                tensor: "block_table",
                index: 3,
                value: 99,
                bound: 8,
            },
            "block_table",
        ),
        (ErrorKind::RotaryWithoutNewKv, "k_new"),
        (ErrorKind::CuSeqlensKNewWithoutNewKv, "cu_seqlens_k_new"),
        (ErrorKind::PagedWithBatchIdx, "cache_batch_idx"),
        (ErrorKind::NumSplits { num_splits: 0 }, "num_splits"),
        (ErrorKind::DropoutInDecode { p: 0.5 }, "dropout"),
        (
            ErrorKind::RotaryDim {
                rotary_dim: 18,
                head_dim: 16,
            },
            "rotary_dim 18",
        ),
    ];
    for (k, needle) in cases {
        let msg = Error::from(k).to_string();
        assert!(msg.contains(needle), "{msg:?} does not name {needle}");
    }
}
