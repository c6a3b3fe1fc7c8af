//! Software prefetch: the request itself (`prefetch_bytes`, also behind
//! `View::prefetch_row`), and for the decode kernels, which stream K/V rows that are each
//! read once, how far ahead they ask ([`PF_KEYS`]) and whether the AVX-512 kernels ask
//! for half-precision rows on this CPU (`half_rows`, [`decode_prefetch_by_default`]).

/// How many keys ahead the decode kernels ask for K/V rows: all rows on AVX2, f16/bf16
/// rows on AVX-512 where `half_rows` says so.
#[cfg(target_arch = "x86_64")]
pub(crate) const PF_KEYS: usize = 16;

/// Asks for the cache lines of `bytes` bytes from `p`. A prefetch is a hint that reads
/// nothing and never faults, so `p` may point anywhere, past the data included.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn prefetch_bytes(p: *const u8, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let mut b = 0;
    while b < bytes {
        // SAFETY: a prefetch touches no memory the program can observe and cannot fault,
        // whatever the address (SSE, which every x86-64 CPU has).
        #[allow(unused_unsafe)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(b))
        };
        b += 64;
    }
}

/// Whether the AVX-512 decode kernels ask for f16/bf16 K/V rows ahead when
/// `CANDLE_ATTENTION_DECODE_PREFETCH` does not say (`1` on, `0` off; read once per
/// process, at the first half-precision decode): on Intel CPUs, where it made bf16 and
/// f16 decode of long caches faster, and not on others (see the kernel notes). Does not
/// read the variable.
pub fn decode_prefetch_by_default() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0: the vendor string, in EBX, EDX, ECX.
        let r = std::arch::x86_64::__cpuid(0);
        [r.ebx, r.edx, r.ecx] == [*b"Genu", *b"ineI", *b"ntel"].map(u32::from_le_bytes)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 decode kernels ask for half-precision K/V rows [`PF_KEYS`] keys
/// ahead: `CANDLE_ATTENTION_DECODE_PREFETCH` if it is `1` or `0` (read once per
/// process), else [`decode_prefetch_by_default`]. On an Intel Xeon VM (AVX-512, AMX) it
/// made bf16 and f16 `decode_b4` about 1.6–2× faster; on an AMD Zen 4 VM it made no
/// consistent difference and slowed bf16 `decode_b4` (kernel notes). f32 rows gained
/// nothing on either, and take none.
#[cfg(target_arch = "x86_64")]
pub(crate) fn half_rows() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || match std::env::var("CANDLE_ATTENTION_DECODE_PREFETCH").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => decode_prefetch_by_default(),
        },
    )
}
