//! The instruction sets the kernel runs on, their runtime detection (with the
//! `CANDLE_ATTENTION_ISA` override), and the dispatch of the block products and the
//! per-row softmax to the matching micro-kernels.
#[cfg(target_arch = "aarch64")]
use super::neon;
use super::portable;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512, view};

/// The CPU's vendor string from CPUID leaf 0 (`b"GenuineIntel"`, `b"AuthenticAMD"`, …):
/// EBX, EDX, ECX in that order.
#[cfg(target_arch = "x86_64")]
pub(crate) fn cpu_vendor() -> [u8; 12] {
    let r = std::arch::x86_64::__cpuid(0);
    let mut v = [0u8; 12];
    for (c, w) in v.chunks_exact_mut(4).zip([r.ebx, r.edx, r.ecx]) {
        c.copy_from_slice(&w.to_le_bytes());
    }
    v
}

/// Instruction set used by the micro-kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// x86-64 AVX-512F and AVX512DQ (6×64 and 12×32 register tiles).
    Avx512,
    /// x86-64 AVX2 + FMA.
    Avx2Fma,
    /// AArch64 NEON.
    Neon,
    /// Portable Rust (auto-vectorised by the compiler).
    Portable,
}

impl Isa {
    /// Name as reported by [`isa`](fn@super::isa).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }

    /// Whether this machine can run the kernel for `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            // DQ for the softmax's `vreduceps` (`avx512::exp2_512`).
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512dq")
            }
            #[cfg(target_arch = "x86_64")]
            // F16C for the decode kernels' f16 rows (`avx2::qk_dot`; every AVX2 CPU has it).
            Isa::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best instruction set available on this machine (ignores the env override).
    pub fn detect() -> Isa {
        if Isa::Avx512.is_supported() {
            Isa::Avx512
        } else if Isa::Avx2Fma.is_supported() {
            Isa::Avx2Fma
        } else if Isa::Neon.is_supported() {
            Isa::Neon
        } else {
            Isa::Portable
        }
    }

    /// [`Isa::detect`], unless `CANDLE_ATTENTION_ISA` names a supported instruction set
    /// (`portable`, `avx2` or `avx512`; an unsupported or unknown name is ignored).
    pub fn selected() -> Isa {
        let forced = match std::env::var("CANDLE_ATTENTION_ISA") {
            Ok(v) if v.eq_ignore_ascii_case("portable") => Some(Isa::Portable),
            Ok(v) if v.eq_ignore_ascii_case("avx2") || v.eq_ignore_ascii_case("avx2+fma") => {
                Some(Isa::Avx2Fma)
            }
            Ok(v) if v.eq_ignore_ascii_case("avx512") => Some(Isa::Avx512),
            _ => None,
        };
        match forced {
            Some(isa) if isa.is_supported() => isa,
            _ => Isa::detect(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn qk(
        self,
        q: &[f32],
        rows: usize,
        e: usize,
        kp: &[f32],
        np: usize,
        s: &mut [f32],
        lds: usize,
    ) {
        match self {
            // SAFETY: `Isa::Avx2Fma` only reaches the kernel after `is_supported()`.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { avx2::qk(q, rows, e, kp, np, s, lds) },
            // SAFETY: `Isa::Avx512` only reaches the kernel after `is_supported()`.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::qk(q, rows, e, kp, np, s, lds) },
            // SAFETY: `Isa::Neon` only reaches the kernel after `is_supported()`.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::qk(q, rows, e, kp, np, s, lds) },
            _ => portable::qk(q, rows, e, kp, np, s, lds),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // `live`: AVX-512 only
    #[inline]
    pub(super) fn pv(
        self,
        p: &[f32],
        rows: usize,
        live: usize,
        nk: usize,
        vp: &[f32],
        vps: usize,
        ldv: usize,
        nvp: usize,
        o: &mut [f32],
        ldo: usize,
        alpha: &[f32],
    ) {
        match self {
            // SAFETY: `Isa::Avx2Fma` only reaches the kernel after `is_supported()`.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { avx2::pv(p, rows, nk, vp, vps, ldv, nvp, o, ldo, alpha) },
            // SAFETY: `Isa::Avx512` only reaches the kernel after `is_supported()`.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::pv(p, rows, live, nk, vp, vps, ldv, nvp, o, ldo, alpha) },
            // SAFETY: `Isa::Neon` only reaches the kernel after `is_supported()`.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::pv(p, rows, nk, vp, vps, ldv, nvp, o, ldo, alpha) },
            _ => portable::pv(p, rows, nk, vp, vps, ldv, nvp, o, ldo, alpha),
        }
    }

    /// Decode scores of the `live` rows against K rows read in place (see
    /// `portable::qk_dot`). `v`, the block's V rows (rows, row stride, row length), may
    /// be asked for into the L2 while the scores run; returns whether they were (AVX2,
    /// `avx2::qk_dot`).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) fn qk_dot(
        self,
        q: &[f32],
        rows: usize,
        live: usize,
        e: usize,
        k: &[f32],
        ldk: usize,
        nk: usize,
        s: &mut [f32],
        lds: usize,
        v: Option<(&[f32], usize, usize)>,
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512 {
            // SAFETY: `Isa::Avx512` only reaches the kernel after `is_supported()`.
            unsafe { avx512::qk_dot(q, rows, live, e, k, ldk, nk, s, lds) };
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx2Fma {
            // SAFETY: `Isa::Avx2Fma` only reaches the kernel after `is_supported()`.
            let v = v.map(|(vs, ldv, ev)| (view::Data::F32(vs), ldv, ev));
            return unsafe { avx2::qk_dot(q, rows, live, e, view::Data::F32(k), ldk, nk, s, lds, v) };
        }
        let _ = (rows, v); // the padding rows are not scored; no V rows are asked for
        portable::qk_dot(q, live, e, k, ldk, nk, s, lds);
        false
    }

    /// Online-softmax update of one score row; see `avx2::online_row`. (AVX-512 updates
    /// whole blocks of rows instead: `avx512::online_rows_lazy`.)
    #[inline]
    pub(super) fn online_row(self, x: &mut [f32], m_old: f32) -> (f32, f32, f32) {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx2Fma {
            // SAFETY: `Isa::Avx2Fma` only reaches the kernel after `is_supported()`.
            return unsafe { avx2::online_row(x, m_old) };
        }
        portable::online_row(x, m_old)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    /// `cpu_vendor` reads the registers in the order that spells the vendor: on Linux it
    /// must equal `/proc/cpuinfo`'s `vendor_id` (a swapped register or byte order gives
    /// `GenuntelineI` or the like).
    #[test]
    fn cpu_vendor_matches_proc_cpuinfo() {
        let v = super::cpu_vendor();
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!(
                "note: no /proc/cpuinfo; vendor {:?} not compared",
                String::from_utf8_lossy(&v)
            );
            return;
        };
        let want = info
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .and_then(|l| l.split(':').nth(1))
            .map(str::trim);
        match want {
            Some(w) => assert_eq!(String::from_utf8_lossy(&v), w),
            None => eprintln!("note: no vendor_id in /proc/cpuinfo"),
        }
    }
}
