//! Input validation: one test per `ErrorKind`, each asserting the exact variant and the values it
//! carries, that the message names the offending tensor (or option), that nothing panics, and that
//! `naive::` and `reference::` validate the same way as `flash_attn`.

use flashattn::{
    flash_attn, merge_attn_partials, naive, reference, AttnOptions, CuSeqlensProblem, DType, Error,
    ErrorKind, TensorRef,
};
use half::{bf16, f16};
use std::panic::{catch_unwind, AssertUnwindSafe};

mod limits;
mod options;
mod properties;
mod shapes;

/// Calls every batched entry point; each must return `Err` (not panic, not `Ok`), all the same one.
fn batched_err(q: &TensorRef, k: &TensorRef, v: &TensorRef, opts: &AttnOptions) -> Error {
    let run = |name: &str, f: &dyn Fn() -> Result<(), Error>| -> Error {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Err(e)) => e,
            Ok(Ok(())) => panic!("{name} accepted an invalid input"),
            Err(_) => panic!("{name} panicked instead of returning an error"),
        }
    };
    let flash = run("flash_attn", &|| flash_attn(q, k, v, opts).map(drop));
    let nv = run("naive::attention", &|| {
        naive::attention(q, k, v, opts).map(drop)
    });
    let r = run("reference::attention", &|| {
        reference::attention(q, k, v, opts).map(drop)
    });
    let row = run("reference::attention_row", &|| {
        reference::attention_row(q, k, v, opts, 0, 0, 0).map(drop)
    });
    // Compared through Debug: NaN-carrying kinds (softcap, scale) are never `==`.
    let same = |a: &Error, b: &Error| format!("{a:?}") == format!("{b:?}");
    assert!(
        same(&flash, &nv),
        "naive validates differently: {nv:?} vs {flash:?}"
    );
    assert!(
        same(&flash, &r),
        "reference validates differently: {r:?} vs {flash:?}"
    );
    assert!(
        same(&flash, &row),
        "reference::attention_row validates differently: {row:?} vs {flash:?}"
    );
    flash
}

/// As [`batched_err`], for the packed entry points.
fn varlen_err(
    q: &TensorRef,
    k: &TensorRef,
    v: &TensorRef,
    cq: &[i32],
    ck: &[i32],
    opts: &AttnOptions,
) -> Error {
    let run = |name: &str, f: &dyn Fn() -> Result<(), Error>| -> Error {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Err(e)) => e,
            Ok(Ok(())) => panic!("{name} accepted an invalid input"),
            Err(_) => panic!("{name} panicked instead of returning an error"),
        }
    };
    let flash = run("flash_attn_varlen", &|| {
        flash_attn(q, k, v, &opts.clone().varlen(cq, ck)).map(drop)
    });
    let nv = run("naive::attention_varlen", &|| {
        naive::attention_varlen(q, k, v, cq, ck, opts).map(drop)
    });
    let r = run("reference::attention_varlen", &|| {
        reference::attention_varlen(q, k, v, cq, ck, opts).map(drop)
    });
    let same = |a: &Error, b: &Error| format!("{a:?}") == format!("{b:?}");
    assert!(
        same(&flash, &nv),
        "naive validates differently: {nv:?} vs {flash:?}"
    );
    assert!(
        same(&flash, &r),
        "reference validates differently: {r:?} vs {flash:?}"
    );
    flash
}

/// The message contains `needle` (a tensor name in backticks, or an option name).
fn assert_names(e: &Error, needle: &str) {
    let msg = e.to_string();
    assert!(
        msg.contains(needle),
        "message {msg:?} does not name {needle:?}"
    );
    // Display of the error and of its kind agree, and the error is a std error.
    assert_eq!(msg, e.kind().to_string());
    let _: &dyn std::error::Error = e;
}

const B: usize = 2;
const SQ: usize = 5;
const SK: usize = 7;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const BATCHED: &str = "[batch, seqlen, heads, head_dim]";
const PACKED: &str = "[total_tokens, heads, head_dim]";

/// Buffers large enough for every valid shape used here.
fn buf() -> Vec<f32> {
    (0..4096).map(|i| (i as f32 * 0.37).sin()).collect()
}

fn qshape() -> [usize; 4] {
    [B, SQ, H, D]
}
fn kshape() -> [usize; 4] {
    [B, SK, HKV, D]
}
