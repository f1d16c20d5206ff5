//! `flashattn compile`: fills the kernel disk cache ahead of time with NVRTC (no GPU needed), so a
//! later process on a GPU of that architecture loads its kernels instead of compiling them.

use crate::error::Result;
use flashattn::cuda::{self, Arch, KernelKey};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct CompileArgs {
    /// Target architecture: sm_80 (Ampere and later, generic) or sm_90a (Hopper).
    #[arg(long, default_value = "sm_90a", value_parser = ["sm_80", "sm_90a"])]
    pub arch: String,
    /// Only the variants whose name contains this text (e.g. `decode`, `bf16`, `fwd_f32`).
    #[arg(long, default_value = "")]
    pub filter: String,
}

pub fn compile(args: &CompileArgs) -> Result<()> {
    let arch = if args.arch == "sm_80" {
        Arch::SM80
    } else {
        Arch::SM90
    };
    let keys: Vec<KernelKey> = KernelKey::all()
        .into_iter()
        .filter(|k| k.builds_for(arch) && k.name().contains(&args.filter))
        .collect();
    let start = Instant::now();
    let report = cuda::precompile(&keys, arch)?;
    let (mut cached, mut built, mut failed) = (0, 0, 0);
    for r in &report.variants {
        match &r.compiled {
            Ok(None) => cached += 1,
            Ok(Some(_)) => built += 1,
            Err(e) => {
                failed += 1;
                eprintln!("{}: {e}", r.key.name());
            }
        }
    }
    let (major, minor) = report.nvrtc;
    println!(
        "NVRTC {major}.{minor}: {} variants for {arch}: {built} compiled, {cached} already cached, {failed} failed, {:.1} s",
        keys.len(),
        start.elapsed().as_secs_f64()
    );
    if failed > 0 {
        return Err(crate::error::CliError(format!(
            "{failed} kernel variants failed to compile"
        )));
    }
    Ok(())
}
