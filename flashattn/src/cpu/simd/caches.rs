//! The data-cache sizes of the CPU a process runs on, read once: the CPU path derives its tile
//! sizes from them ([`crate::cpu::block_sizes`]) instead of constants tuned on one host.
//!
//! Sources, first that answers: the `FLASHATTN_CACHE_SIZES` environment variable
//! (`l1d,l2[,l3]` per core, each in bytes or with a `K`/`M` suffix: to pretend to be another CPU),
//! Linux's `/sys/devices/system/cpu/cpu0/cache/index*`, the x86 CPUID cache leaves (4 on Intel,
//! 0x8000001D on AMD), else a conservative guess (32 KiB, 512 KiB, 1 MiB). Shared levels are
//! divided by the number of logical CPUs sharing them, so each size is one thread's share.

use std::fmt;
use std::sync::OnceLock;

/// Data-cache bytes available to one logical CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSizes {
    pub l1d: usize,
    pub l2: usize,
    /// The last level's share per logical CPU (0 when there is none).
    pub l3: usize,
    /// Where the sizes came from: `env`, `sysfs`, `cpuid` or `default`.
    pub source: &'static str,
}

impl CacheSizes {
    /// What [`cache_sizes`] assumes when nothing answers.
    pub const DEFAULT: CacheSizes = CacheSizes {
        l1d: 32 << 10,
        l2: 512 << 10,
        l3: 1 << 20,
        source: "default",
    };
}

impl fmt::Display for CacheSizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "L1d {}, L2 {}, L3 {} per core ({})",
            kib(self.l1d),
            kib(self.l2),
            kib(self.l3),
            self.source
        )
    }
}

fn kib(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// This CPU's cache sizes (read once per process; see the module documentation).
pub fn cache_sizes() -> CacheSizes {
    static SIZES: OnceLock<CacheSizes> = OnceLock::new();
    *SIZES.get_or_init(|| {
        std::env::var("FLASHATTN_CACHE_SIZES")
            .ok()
            .and_then(|s| parse_env(&s))
            .or_else(from_sysfs)
            .or_else(from_cpuid)
            .unwrap_or(CacheSizes::DEFAULT)
    })
}

/// `l1d,l2[,l3]`; `None` (ignored) when malformed or a size is 0.
pub(crate) fn parse_env(s: &str) -> Option<CacheSizes> {
    let sizes: Vec<usize> = s
        .split(',')
        .map(|x| parse_size(x.trim()))
        .collect::<Option<_>>()?;
    match sizes[..] {
        [l1d, l2] if l1d > 0 && l2 > 0 => Some(CacheSizes {
            l1d,
            l2,
            l3: 0,
            source: "env",
        }),
        [l1d, l2, l3] if l1d > 0 && l2 > 0 => Some(CacheSizes {
            l1d,
            l2,
            l3,
            source: "env",
        }),
        _ => None,
    }
}

/// `48K`, `2M`, `2MiB`, `49152`.
fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim_end_matches("iB").trim_end_matches('B');
    let (num, mult) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

/// Logical CPUs in a sysfs CPU list such as `0-3,8-11`.
fn count_cpus(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().ok()?.checked_sub(a.parse().ok()?)? + 1,
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

fn from_sysfs() -> Option<CacheSizes> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let read = |i: usize, f: &str| std::fs::read_to_string(dir.join(format!("index{i}/{f}"))).ok();
    let mut sizes = [0usize; 4];
    for i in 0..16 {
        let Some(level) = read(i, "level") else { break };
        let level: usize = level.trim().parse().ok()?;
        let kind = read(i, "type")?;
        if !matches!(kind.trim(), "Data" | "Unified") || !(1..=3).contains(&level) {
            continue;
        }
        let size = parse_size(read(i, "size")?.trim())?;
        let sharing = read(i, "shared_cpu_list")
            .and_then(|l| count_cpus(&l))
            .unwrap_or(1);
        sizes[level] = size / sharing;
    }
    (sizes[1] > 0 && sizes[2] > 0).then_some(CacheSizes {
        l1d: sizes[1],
        l2: sizes[2],
        l3: sizes[3],
        source: "sysfs",
    })
}

/// Whether CPUID names the vendor "GenuineIntel" (read once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn cpu_is_intel() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        let v = std::arch::x86_64::__cpuid_count(0, 0);
        (v.ebx, v.edx, v.ecx)
            == (
                u32::from_le_bytes(*b"Genu"),
                u32::from_le_bytes(*b"ineI"),
                u32::from_le_bytes(*b"ntel"),
            )
    })
}

#[cfg(target_arch = "x86_64")]
fn from_cpuid() -> Option<CacheSizes> {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 0's vendor string decides the cache leaf: "AuthenticAMD" (and Hygon) describe caches in
    // 0x8000001D, with the same register layout as Intel's leaf 4.
    let v = __cpuid_count(0, 0);
    let amd = v.ebx == u32::from_le_bytes(*b"Auth") || v.ebx == u32::from_le_bytes(*b"Hygo");
    let leaf = if amd {
        if __cpuid_count(0x8000_0000, 0).eax < 0x8000_001D {
            return None;
        }
        0x8000_001D
    } else {
        if v.eax < 4 {
            return None;
        }
        4
    };
    let mut sizes = [0usize; 4];
    for sub in 0..16 {
        let r = __cpuid_count(leaf, sub);
        let kind = r.eax & 0x1F; // 0 none, 1 data, 2 instruction, 3 unified
        if kind == 0 {
            break;
        }
        let level = ((r.eax >> 5) & 7) as usize;
        if kind == 2 || !(1..=3).contains(&level) {
            continue;
        }
        let ways = ((r.ebx >> 22) & 0x3FF) as usize + 1;
        let partitions = ((r.ebx >> 12) & 0x3FF) as usize + 1;
        let line = (r.ebx & 0xFFF) as usize + 1;
        let sets = r.ecx as usize + 1;
        let sharing = ((r.eax >> 14) & 0xFFF) as usize + 1;
        sizes[level] = ways * partitions * line * sets / sharing;
    }
    (sizes[1] > 0 && sizes[2] > 0).then_some(CacheSizes {
        l1d: sizes[1],
        l2: sizes[2],
        l3: sizes[3],
        source: "cpuid",
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn from_cpuid() -> Option<CacheSizes> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_sizes_parse() {
        let c = parse_env("32K,512K").expect("two sizes");
        assert_eq!(
            (c.l1d, c.l2, c.l3, c.source),
            (32 << 10, 512 << 10, 0, "env")
        );
        let c = parse_env("49152, 2M, 32MiB").expect("three sizes");
        assert_eq!((c.l1d, c.l2, c.l3), (49152, 2 << 20, 32 << 20));
        assert_eq!(parse_env("32K"), None);
        assert_eq!(parse_env("0,512K"), None);
        assert_eq!(parse_env("32K,lots"), None);
    }

    #[test]
    fn cpu_lists_count() {
        assert_eq!(count_cpus("0"), Some(1));
        assert_eq!(count_cpus("0-1\n"), Some(2));
        assert_eq!(count_cpus("0-3,8-11"), Some(8));
        assert_eq!(count_cpus(""), None);
    }

    #[test]
    fn this_cpu_has_sizes() {
        let c = cache_sizes();
        assert!(c.l1d >= 4 << 10 && c.l2 >= c.l1d, "{c}");
        #[cfg(target_arch = "x86_64")]
        if let Some(c) = from_cpuid() {
            assert!(c.l1d >= 4 << 10 && c.l2 >= c.l1d, "cpuid: {c}");
        }
    }
}
