//! Library discovery fails cleanly: FLASHATTN_NVRTC naming a place without libnvrtc gives a typed
//! error listing what was searched, never a panic (cudarc itself panics on a missing library, so
//! flashattn must not reach it). One test per process: the probe's answer is cached.
#![cfg(feature = "cuda")]

#[test]
fn nvrtc_at_a_bad_path_is_a_typed_error() {
    let dir = tempfile_dir();
    std::env::set_var("FLASHATTN_NVRTC", &dir);
    let e = flashattn::cuda::nvrtc_version().unwrap_err();
    match e.kind() {
        flashattn::ErrorKind::NvrtcUnavailable { searched } => {
            assert_eq!(searched, &vec![dir.display().to_string()]);
        }
        other => panic!("expected NvrtcUnavailable, got {other:?}"),
    }
    // Compiling needs NVRTC too: the same error, again without a panic.
    let key = flashattn::cuda::KernelKey::all()[0];
    assert!(flashattn::cuda::compile(&key, flashattn::cuda::Arch::SM80).is_err());
    let _ = std::fs::remove_dir(&dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("flashattn-no-nvrtc-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
