//! `FLASHATTN_ISA` is read once per process, so this test binary holds the one test that sets it.

use flashattn::{flash_attn, ErrorKind, TensorRef};

#[test]
fn unknown_isa_name_is_a_typed_error_in_every_call() {
    // Set before the first call of this process reads it; no other test runs in this binary.
    std::env::set_var("FLASHATTN_ISA", "sse9");
    let q = [0.5f32; 8];
    let t = TensorRef::contiguous(&q, &[1, 2, 1, 4]);
    let err = flash_attn(&t, &t, &t, &Default::default()).unwrap_err();
    assert_eq!(
        err.kind(),
        &ErrorKind::IsaUnknown {
            name: "sse9".into()
        }
    );
    assert!(err.to_string().contains("sse9"), "{err}");
    assert!(flashattn::simd::active().is_err());
    // An explicit choice in the options does not consult the variable.
    let opts = flashattn::AttnOptions::default().isa(flashattn::simd::Isa::Scalar);
    assert!(flash_attn(&t, &t, &t, &opts).is_ok());
}
