//! The AVX-512 decode kernels: scores and `P·V` against K/V rows read in place (f32, or
//! f16/bf16 widened in registers), for the few query rows of a decode step.

use super::products::{pv_tile, PvSrc};
use super::*;

/// What the row-reading score kernels ([`qk_dot_raw`]) ask for ahead of reading it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ahead {
    /// Nothing.
    Off,
    /// Each K row `n` rows ahead, whole, as a row is read (decode: the rows of one head,
    /// at any row stride, mostly of 64–256 elements).
    Keys(usize),
    /// Each 64-byte line `n` bytes past the one being read (`linear`: weight rows of
    /// thousands of elements stored one after the other, read as one stream).
    Bytes(usize),
}

impl Ahead {
    /// How far past the start of the row being read (rows `ldk` elements of `size` bytes
    /// apart) [`Ahead::Keys`] and [`Ahead::Bytes`] ask, in bytes (0 for [`Ahead::Off`]).
    #[inline]
    fn row_offset(self, ldk: usize, size: usize) -> usize {
        match self {
            Ahead::Off => 0,
            Ahead::Keys(n) => n * ldk * size,
            Ahead::Bytes(n) => n,
        }
    }
}

/// Puts each whole 32-element group of `row` in the split layout of
/// [`load32_bf16_split`]: its 16 even elements, then its 16 odd ones. A tail of fewer
/// than 32 stays as it is.
pub(in crate::kernels::cpu) fn split_pairs(row: &mut [f32]) {
    for g in row.chunks_exact_mut(32) {
        let t: [f32; 32] = std::array::from_fn(|i| g[(i % 16) * 2 + i / 16]);
        g.copy_from_slice(&t);
    }
}

/// The inverse of [`split_pairs`] on the first `groups` 32-element groups of `row`.
pub(in crate::kernels::cpu) fn merge_pairs(row: &mut [f32], groups: usize) {
    for g in row.chunks_exact_mut(32).take(groups) {
        let t: [f32; 32] = std::array::from_fn(|i| g[(i % 2) * 16 + i / 2]);
        g.copy_from_slice(&t);
    }
}

/// See [`super::super::portable::qk_dot`]: scores against row-major keys (decode path).
/// `rows` must be a multiple of [`MR`]; any `e`. Only the first `live` rows are computed
/// (the rest are padding and get 0).
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn qk_dot(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: &[f32],
    ldk: usize,
    nk: usize,
    s: &mut [f32],
    lds: usize,
) {
    assert!(rows.is_multiple_of(MR) && lds >= nk && q.len() >= rows * e);
    assert!(nk == 0 || k.len() >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        qk_dot_impl::<F32>(
            q.as_ptr(),
            rows,
            live.min(rows),
            e,
            (k.as_ptr() as *const u8, ldk, nk, Ahead::Off),
            s.as_mut_ptr(),
            lds,
            None,
        )
    };
}

/// [`qk_dot`] with K rows read straight from the source (f32, bf16 or f16), widened in
/// registers (decode path). Half-precision keys need `e % 16 == 0`. With bf16 keys, the
/// Q rows must be in the split layout of [`split_pairs`]. `ahead` says what to ask for
/// ahead of reading it (a hint: results do not depend on it).
///
/// `v`: the block's V rows (`(rows, row stride, row length)`, one per key), for the
/// first strip to ask for into the L2 while it scores f32 K rows ([`AskRows`]): a strip
/// with the rows in the lanes where the V rows hold [`V_ASK_MIN_EV_LANES`] elements or
/// more, a register strip (E = 64, 128 or 256) where they hold [`V_ASK_MIN_EV_STRIPS`]
/// or more, or 128 or more in a strip of [`V_ASK_MIN_ROWS_128`] rows or more
/// ([`strip_asks_v`]). Returns whether it did. With f16/bf16 K rows nothing is asked for (on the
/// Zen 4 VM, rows of 256: bf16 0.990–1.116 of the time without, f16 0.771–1.107; kernel
/// notes).
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn qk_dot_raw(
    q: &[f32],
    rows: usize,
    live: usize,
    e: usize,
    k: Data,
    (ldk, nk, ahead): (usize, usize, Ahead),
    s: &mut [f32],
    lds: usize,
    v: Option<(Data, usize, usize)>,
) -> bool {
    let (ptr, len) = data_ptr(k);
    assert!(rows.is_multiple_of(MR) && lds >= nk && q.len() >= rows * e);
    assert!(matches!(k, Data::F32(_)) || e.is_multiple_of(16));
    assert!(nk == 0 || len >= (nk - 1) * ldk + e);
    assert!(rows == 0 || s.len() >= (rows - 1) * lds + nk);
    let (qp, live, sp) = (q.as_ptr(), live.min(rows), s.as_mut_ptr());
    // (Only f32 K rows ask for V rows, and only for rows of `V_ASK_MIN_EV_LANES` or more.)
    let v = v
        .filter(|&(_, _, ev)| matches!(k, Data::F32(_)) && ev >= V_ASK_MIN_EV_LANES)
        .map(|(vs, ldv, ev)| AskRows::new(vs, ldv, ev, nk));
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match k {
            Data::F32(_) => qk_dot_impl::<F32>(qp, rows, live, e, (ptr, ldk, nk, ahead), sp, lds, v),
            Data::BF16(_) => qk_dot_impl::<BF16>(qp, rows, live, e, (ptr, ldk, nk, ahead), sp, lds, None),
            Data::F16(_) => qk_dot_impl::<F16>(qp, rows, live, e, (ptr, ldk, nk, ahead), sp, lds, None),
        }
    }
}

/// Horizontal sums of 16 registers at once: lane `i` of the result is `Σ regs[i]`, by a
/// transpose-and-add tree (15 shuffle pairs instead of 16 full reductions).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn reduce16(regs: [__m512; 16]) -> __m512 {
    // 16 → 8: within each 128-bit lane, (a0 + a2, b0 + b2, a1 + a3, b1 + b3).
    let b: [__m512; 8] = std::array::from_fn(|i| {
        let (x0, x1) = (regs[2 * i], regs[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x0, x1), _mm512_unpackhi_ps(x0, x1))
    });
    // 8 → 4: each 128-bit lane holds partial sums of four consecutive registers.
    let c: [__m512; 4] = std::array::from_fn(|i| {
        let (x0, x1) = (b[2 * i], b[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x0, x1),
            _mm512_shuffle_ps::<0xEE>(x0, x1),
        )
    });
    // 4 → 2 → 1: sum the four 128-bit lanes of each group.
    let d: [__m512; 2] = std::array::from_fn(|i| {
        let (x0, x1) = (c[2 * i], c[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x0, x1),
            _mm512_shuffle_f32x4::<0xEE>(x0, x1),
        )
    });
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(d[0], d[1]),
        _mm512_shuffle_f32x4::<0xDD>(d[0], d[1]),
    )
}

/// Whether a decode score strip of `rows` rows with K elements of type `T` reduces each
/// key's sums as soon as they are in ([`store_key_sums`]) rather than 16 keys' sums
/// together ([`reduce16`]): f32 strips of one or two rows, the decode of attention
/// without GQA (one row per group) or with two query heads per KV head.
///
/// Reading K from DRAM, such strips ran faster that way, although they issue more
/// instructions; wider strips and half-precision rows did not. On the Zen 4 VM (one
/// thread, in-process, rate new/old): one row 1.06–1.10 at E = 128, 1.03–1.09 at 64,
/// 1.01 at 256 and 1.00–1.05 at 48, 80 and 96; two rows 1.05–1.10; four rows 0.99–1.00
/// from DRAM and 0.91 from L3, eight 0.91; bf16 0.94–1.00 and f16 0.90–0.94. With both
/// threads, `decode_b4`'s shape read 1.06–1.07 (kernel notes).
#[inline]
fn per_key_sums<const T: u8>(rows: usize) -> bool {
    T == F32 && rows <= 2
}

/// Stores the horizontal sum of each of `acc`'s `R` registers, one key's scores of `R`
/// rows, at `s + r·lds`.
///
/// # Safety
/// AVX-512F must be available; `s + r·lds` is writable for every `r < R`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_key_sums<const R: usize>(acc: [__m512; R], s: *mut f32, lds: usize) {
    for (r, a) in acc.into_iter().enumerate() {
        *s.add(r * lds) = _mm512_reduce_add_ps(a);
    }
}

/// Decode scores `S = Q·Kᵀ` (`q`: `rows × e` row-major; K row `j` at element `j·ldk`;
/// `s`: row stride `lds`) that walk each K row to its end before the next, keys in
/// order. The hardware prefetchers follow such reads from DRAM; they did not follow the
/// earlier kernel's, which read 16 (one live row) or 4 keys' rows interleaved, 64 bytes
/// of each in turn (on the Zen 4 VM a plain read of 64-key K/V blocks in row order ran
/// at 25–32 GB/s on both threads, with rows interleaved 4 or 16 at a time at 12–20).
/// Live rows go in strips of up to 8 (E = 64 and 128), 4 (E = 256) or [`MR`] (other
/// head sizes); each strip reads the K block once (the first from memory, the others
/// from cache). Strips of one or two f32 rows store each key's scores as soon as they
/// are in, wider ones 16 keys' at a time ([`per_key_sums`]). Padding rows
/// (`live..rows`) get zero scores.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn qk_dot_impl<const T: u8>(
    q: *const f32,
    rows: usize,
    live: usize,
    e: usize,
    (k, ldk, nk, ahead): (*const u8, usize, usize, Ahead),
    s: *mut f32,
    lds: usize,
    v: Option<AskRows>,
) -> bool {
    let mut asked = false;
    let mut r0 = 0;
    while r0 < live {
        let (qs, sp) = (q.add(r0 * e), s.add(r0 * lds));
        let rem = live - r0;
        // Twelve rows or more of f32 keys: up to 16 rows in the lanes (`qk_lanes`); the
        // first such strip asks for the V rows.
        if T == F32 && rem >= LANES_MIN_ROWS && lanes_head_size(e) {
            let r = rem.min(16);
            let va = if r0 == 0 { v } else { None };
            asked |= va.is_some();
            qk_lanes(qs, r, e, (k as *const f32, ldk, nk), sp, lds, va);
            r0 += r;
            continue;
        }
        // Seven to eleven on a CPU whose AVX-512 runs as two 256-bit halves: up to 8 rows
        // in the lanes of the AVX2 strips (`lanes8`).
        if T == F32 && rem >= LANES8_MIN_ROWS && lanes_head_size(e) && lanes8() {
            let r = rem.min(8);
            // SAFETY: `lanes8` found AVX2 and FMA; the rows, keys and scores as for
            // `qk_lanes` (the caller's bounds).
            let va = if r0 == 0 { v } else { None };
            asked |= va.is_some();
            unsafe { super::super::avx2::qk_lanes(qs, r, e, (k as *const f32, ldk, nk), sp, lds, va) };
            r0 += r;
            continue;
        }
        // Common head sizes: strips of up to 8 rows (4 with 256 elements), up to 16
        // vectors of Q in registers.
        let r = match e {
            64 | 128 => rem.min(8),
            256 => rem.min(4),
            _ => rem.min(MR),
        };
        // (The first strip asks for V rows where `strip_asks_v` says, each key's as it
        // reads the K row; the strips of other head sizes ask for nothing.)
        let vs = v.filter(|v| r0 == 0 && matches!(e, 64 | 128 | 256) && strip_asks_v(r, v.row_bytes()));
        asked |= vs.is_some();
        let args = (qs, k, ldk, nk, sp, lds, ahead, vs);
        let kr = (k, ldk, nk, ahead);
        match (e, r) {
            (64, 1) => qk_rows_strip_reg::<T, 1, 1, 4>(args),
            (64, 2) => qk_rows_strip_reg::<T, 2, 2, 4>(args),
            (64, 3) => qk_rows_strip_reg::<T, 3, 3, 4>(args),
            (64, 4) => qk_rows_strip_reg::<T, 4, 4, 4>(args),
            (64, 5) => qk_rows_strip_reg::<T, 5, 4, 4>(args),
            (64, 6) => qk_rows_strip_reg::<T, 6, 4, 4>(args),
            (64, 7) => qk_rows_strip_reg::<T, 7, 4, 4>(args),
            (64, _) => qk_rows_strip_reg::<T, 8, 4, 4>(args),
            (128, 1) => qk_rows_strip_reg::<T, 1, 1, 8>(args),
            (128, 2) => qk_rows_strip_reg::<T, 2, 2, 8>(args),
            (128, 3) => qk_rows_strip_reg::<T, 3, 2, 8>(args),
            (128, 4) => qk_rows_strip_reg::<T, 4, 2, 8>(args),
            (128, 5) => qk_rows_strip_reg::<T, 5, 2, 8>(args),
            (128, 6) => qk_rows_strip_reg::<T, 6, 2, 8>(args),
            (128, 7) => qk_rows_strip_reg::<T, 7, 2, 8>(args),
            (128, _) => qk_rows_strip_reg::<T, 8, 2, 8>(args),
            (256, 1) => qk_rows_strip_reg::<T, 1, 1, 16>(args),
            (256, 2) => qk_rows_strip_reg::<T, 2, 1, 16>(args),
            (256, 3) => qk_rows_strip_reg::<T, 3, 1, 16>(args),
            (256, _) => qk_rows_strip_reg::<T, 4, 1, 16>(args),
            (_, 1) => qk_rows_strip::<T, 1>(qs, e, kr, sp, lds),
            (_, 2) => qk_rows_strip::<T, 2>(qs, e, kr, sp, lds),
            (_, 3) => qk_rows_strip::<T, 3>(qs, e, kr, sp, lds),
            (_, 4) => qk_rows_strip::<T, 4>(qs, e, kr, sp, lds),
            (_, 5) => qk_rows_strip::<T, 5>(qs, e, kr, sp, lds),
            _ => qk_rows_strip::<T, MR>(qs, e, kr, sp, lds),
        }
        r0 += r;
    }
    // Padding rows get zero scores.
    for r in live..rows {
        std::ptr::write_bytes(s.add(r * lds), 0, nk);
    }
    asked
}

/// Shortest f32 V rows (elements) that [`qk_dot_raw`] asks for into the L2 while its
/// first strip scores with the rows in the lanes ([`qk_lanes`], and the AVX2 strips of
/// [`lanes8`]): those strips read 8 or 16 K rows interleaved, and `P·V` reads the V
/// rows in tiles of a few panels ([`pv_rows`]). On the Zen 4 VM (both threads, f32,
/// in-process probe, time asking over time not, 16–24 pairs, outputs the same bits):
/// rows of 256 with 8 rows per group 0.686–0.777 (from DRAM 0.732), 16 rows 0.856–0.864;
/// rows of 128 with 7–10 rows 0.891–0.957 (from DRAM 0.970–1.005), 12–32 rows over 2048
/// keys (K/V in the L3) 0.933–0.994 and over 4096 keys 0.967–1.081 (from DRAM
/// 0.956–1.040); rows of 96 0.981 and 1.004; rows of 64 1.028–1.096, hence not those
/// (kernel notes, "AVX-512 decode asks for V rows too").
pub(in crate::kernels::cpu) const V_ASK_MIN_EV_LANES: usize = 128;

/// Shortest f32 V rows (elements) that [`qk_dot_raw`] asks for into the L2 while its
/// first strip scores with the head dimension in the lanes ([`qk_rows_strip_reg`], each
/// key's V row as its K row is read). Gemma's heads of 256 on the Zen 4 VM (as for
/// [`V_ASK_MIN_EV_LANES`]): 1 row per group 0.830 (from DRAM 0.957), 2 rows 0.835–0.871
/// (from DRAM 0.774), 4 rows 0.754; with rows of 128, 1.137 (2 rows), as in an earlier
/// try (1.022 on `decode_b4`'s and `decode_gqa`'s shapes), hence not those, except in
/// strips of [`V_ASK_MIN_ROWS_128`] rows or more.
pub(in crate::kernels::cpu) const V_ASK_MIN_EV_STRIPS: usize = 256;

/// Fewest rows of a first register strip ([`qk_rows_strip_reg`]) that asks for f32 V
/// rows of 128 to 255 elements too ([`strip_asks_v`]). Asking for V alone made those
/// slower ([`V_ASK_MIN_EV_STRIPS`]); since `P·V` asks for the next block's K rows
/// wherever the scores asked for V ([`pv_rows`]), the two together pay from 3 rows. On
/// the Zen 4 VM (both threads, f32 `B,Hq,8,1,S,128`, in-process probe, time asking over
/// time not, 16 pairs, outputs the same bits): 3 rows 0.895–0.960, 4 rows
/// (`decode_gqa`'s shape) 0.834–0.862, from DRAM 0.920–0.927 and over 16384 keys
/// 0.873, 5 rows 0.870–0.883, 6 rows 0.750–0.815; but 1 row (`decode_b4`'s shape)
/// 1.022–1.042, and 1.181 with K/V in the L3, 2 rows 1.024–1.044 (kernel notes, "`P·V`
/// asks for the next block's K rows").
pub(in crate::kernels::cpu) const V_ASK_MIN_ROWS_128: usize = 3;

/// Whether a first register strip of `r` rows asks for f32 V rows of `ev_bytes` bytes:
/// rows of [`V_ASK_MIN_EV_STRIPS`] elements or more, or of 128 or more in strips of
/// [`V_ASK_MIN_ROWS_128`] rows or more.
fn strip_asks_v(r: usize, ev_bytes: usize) -> bool {
    ev_bytes >= 4 * V_ASK_MIN_EV_STRIPS || (r >= V_ASK_MIN_ROWS_128 && ev_bytes >= 4 * 128)
}

/// Fewest live rows that [`qk_dot_impl`] puts in the lanes of one strip ([`qk_lanes`]):
/// a strip of 12 leaves a quarter of each vector idle. On the Zen 4 VM (both threads,
/// f32 decode over 4096 keys of 128 from DRAM and L3, in-process probe against the
/// strips of up to 8 rows, time new/old): 9 rows 0.975, 10 rows 1.042, 12 rows 0.948,
/// 14 rows 0.946, 16 rows 0.856–0.885 (0.885 at E = 64), 20 rows 0.873 (kernel notes).
pub(in crate::kernels::cpu) const LANES_MIN_ROWS: usize = 12;

/// Fewest live rows that [`qk_dot_impl`] puts in a strip of 8 rows in the lanes of the
/// AVX2 strips (`avx2::decode::qk_lanes`, 256-bit vectors) where [`lanes8`] says so. On
/// the Zen 4 VM (both threads, f32 over 4096 keys, in-process probe against the strips of
/// up to 8 rows, time new/old): 4 rows 1.134, 5 rows 1.078, 6 rows 0.989, 7 rows
/// 0.935–0.947, 8 rows 0.819–0.864 (Llama 3 70B's 8 query heads per KV head at one token
/// 0.864, of 64 0.983), 9 rows 0.888, 10 rows 0.849, 11 rows 0.951, four batch rows of 8
/// 0.862 (kernel notes).
pub(in crate::kernels::cpu) const LANES8_MIN_ROWS: usize = 7;

/// Whether groups of [`LANES8_MIN_ROWS`] to 11 f32 rows take the AVX2 strips with 8 rows
/// in the lanes: on AMD family 25 (Zen 3 has no AVX-512; Zen 4 runs each 512-bit FMA as
/// two 256-bit halves, so 256-bit FMAs lose nothing), with AVX2 and FMA. Where a CPU
/// runs 512-bit FMAs at full width (Intel's server cores, Zen 5), 256-bit vectors would
/// halve the peak; those CPUs were not measured, and keep the strips that reduce across
/// 16 lanes. Read once per process.
fn lanes8() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let amd = super::super::isa::cpu_vendor() == *b"AuthenticAMD";
        // CPUID leaf 1: EAX's family fields (base + extended).
        let eax = std::arch::x86_64::__cpuid(1).eax;
        let family = ((eax >> 8) & 0xf) + ((eax >> 20) & 0xff);
        amd && family == 0x19 && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    })
}

/// Whether [`qk_lanes`] takes rows of `e` elements: a multiple of 16 (its Q transpose)
/// up to 256 (its Q buffer).
pub(in crate::kernels::cpu) fn lanes_head_size(e: usize) -> bool {
    e > 0 && e.is_multiple_of(16) && e <= 256
}

/// Decode scores of `nr ≤ 16` rows with the rows in the lanes: `Qᵀ` (`e × 16`, rows
/// `nr..16` zero) is built once, then each tile of 16 keys accumulates
/// `acc[c] += Qᵀ[x] · K[j + c][x]` over `x < e`, broadcasting each K element from its row
/// in place (f32, row stride `ldk`), and a 16×16 transpose stores the tile as 16 keys of
/// each score row (`s`, row stride `lds`).
///
/// The strips of [`qk_rows_strip_reg`] put the head dimension in the lanes and reduce
/// each score across them ([`reduce16`]), which costs about a third of the FMAs again at
/// E = 128 and two thirds at 64; here no score needs a reduction. Reading 16 K rows at
/// once, the tiles ask for the next tile's 16 rows as they go (one line per step when
/// the rows follow each other, `ldk = e`; otherwise all of them before the tile). Without
/// that, the hardware prefetchers did not follow the 16 interleaved rows from DRAM, and
/// the kernel took 1.14 of the old time on 16 rows of 128 (kernel notes). One thread, 16
/// rows of 128 against 256 keys in L2: 100–104 GFLOP/s against 84–86 for two strips of
/// 8 rows, with a one-core peak of about 117.
///
/// With `v`, each tile also asks for its 16 keys' V rows into the L2 ([`AskRows`]): four
/// lines per loop where they follow each other and are as long as the K rows, else all
/// of them before the tile.
///
/// # Safety
/// AVX-512F must be available; `qs` holds `nr` rows of `e` elements
/// ([`lanes_head_size`]); K rows `0..nk` at `k + j·ldk` hold `e` elements; `s` holds
/// `nr` rows of stride `lds ≥ nk`.
// (Out of line: its 34 KB of stack would otherwise be probed page by page at every
// call of `qk_dot_impl`, whatever strips the call takes.)
#[inline(never)]
#[target_feature(enable = "avx512f")]
unsafe fn qk_lanes(
    qs: *const f32,
    nr: usize,
    e: usize,
    (k, ldk, nk): (*const f32, usize, usize),
    s: *mut f32,
    lds: usize,
    v: Option<AskRows>,
) {
    debug_assert!(nr <= 16 && lanes_head_size(e));
    // Q rows padded to 16 with zeros, then transposed: `qt[x·16 + r]`, written whole for
    // `x < e` by the transposes (left uninitialised, not cleared: 32 KB per call).
    let mut qpad = std::mem::MaybeUninit::<[f32; 16 * 256]>::uninit();
    let qpad = qpad.as_mut_ptr() as *mut f32;
    std::ptr::copy_nonoverlapping(qs, qpad, nr * e);
    std::ptr::write_bytes(qpad.add(nr * e), 0, (16 - nr) * e);
    let mut qt = std::mem::MaybeUninit::<[f32; 16 * 256]>::uninit();
    let qt = qt.as_mut_ptr() as *mut f32;
    for x0 in (0..e).step_by(16) {
        super::transpose16(qpad.add(x0), e, qt.add(x0 * 16), 16);
    }
    let (mut tile, mut rows) = ([0f32; 256], [0f32; 256]);
    let follow = ldk == e;
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(16);
        // The next tile's rows (past the block's last key too: a prefetch never faults,
        // and with `ldk = e` the rows after the block are the next block's).
        let next = k.wrapping_add((j + 16) * ldk);
        if !follow {
            for c in 0..16 {
                prefetch_bytes(next.wrapping_add(c * ldk) as *const u8, e * 4);
            }
        }
        // This tile's V rows, four lines per loop if they follow each other and are `e`
        // long (the loop runs `e/4` times over the `e` lines of 16 rows), else all of
        // them now.
        let vpf = v.and_then(|v| {
            let at = v.contiguous(4 * e, j);
            if at.is_none() || cnt < 16 {
                v.ask(j, cnt);
            }
            at
        });
        let acc = if cnt == 16 {
            // SAFETY: 16 rows of `e` elements from `k + j·ldk`, and `e` steps of `qt`.
            unsafe { lanes_loop_16(k.add(j * ldk), ldk * 4, qt, e / 4, (follow.then_some(next), vpf)) }
        } else {
            // A tail of fewer than 16 keys: the lanes of keys past `nk` repeat the last
            // key, and their scores are not stored.
            let kr: [*const f32; 16] = std::array::from_fn(|c| k.add((j + c.min(cnt - 1)) * ldk));
            let mut acc = [_mm512_setzero_ps(); 16];
            for x in 0..e {
                let qv = _mm512_loadu_ps(qt.add(x * 16));
                for (a, r) in acc.iter_mut().zip(&kr) {
                    *a = _mm512_fmadd_ps(qv, _mm512_set1_ps(*r.add(x)), *a);
                }
            }
            acc
        };
        for (c, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(tile.as_mut_ptr().add(16 * c), *a);
        }
        super::transpose16(tile.as_ptr(), 16, rows.as_mut_ptr(), 16);
        for r in 0..nr {
            let v = _mm512_loadu_ps(rows.as_ptr().add(16 * r));
            _mm512_mask_storeu_ps(s.add(r * lds + j), tail_mask_full(cnt), v);
        }
        j += 16;
    }
}

macro_rules! lanes_step {
    ($q:literal, $d:literal) => {
        concat!(
            "vmovups zmm16, zmmword ptr [{qt} + ",
            $q,
            "]\n",
            "vfmadd231ps zmm0, zmm16, dword ptr [{g0} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm1, zmm16, dword ptr [{g0} + {l} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm2, zmm16, dword ptr [{g0} + {l}*2 + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm3, zmm16, dword ptr [{g0} + {l3} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm4, zmm16, dword ptr [{g1} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm5, zmm16, dword ptr [{g1} + {l} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm6, zmm16, dword ptr [{g1} + {l}*2 + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm7, zmm16, dword ptr [{g1} + {l3} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm8, zmm16, dword ptr [{g2} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm9, zmm16, dword ptr [{g2} + {l} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm10, zmm16, dword ptr [{g2} + {l}*2 + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm11, zmm16, dword ptr [{g2} + {l3} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm12, zmm16, dword ptr [{g3} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm13, zmm16, dword ptr [{g3} + {l} + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm14, zmm16, dword ptr [{g3} + {l}*2 + ",
            $d,
            "]{{1to16}}\n",
            "vfmadd231ps zmm15, zmm16, dword ptr [{g3} + {l3} + ",
            $d,
            "]{{1to16}}\n",
        )
    };
}

/// [`qk_lanes`]' tile loop in assembly: `acc[c] = Σ_x qt[x] · k_c[x]` for 16 rows `k_c`
/// at byte `c·l` from `k`, over `4·n` steps (16 FMAs per step, each with its K element
/// as a broadcast memory operand, and one load of `qt[x]`, 16 floats). The rows are
/// addressed from four group pointers and `l`, `2·l`, `3·l`, four steps per pass; in
/// intrinsics the compiler kept 16 row pointers and reloaded six of them from the stack
/// at every step. With `next`, each pass also asks for four lines from `next` on (one
/// per step: the next 16 rows when they follow each other), and with `v` four lines from
/// `v` on into the L2.
///
/// # Safety
/// AVX-512F must be available; the 16 rows hold `4·n` floats each, `qt` `64·n`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lanes_loop_16(
    k: *const f32,
    l: usize,
    qt: *const f32,
    n: usize,
    (next, v): (Option<*const f32>, Option<*const u8>),
) -> [__m512; 16] {
    let z = _mm512_setzero_ps();
    let (mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7) = (z, z, z, z, z, z, z, z);
    let (mut c8, mut c9, mut c10, mut c11, mut c12, mut c13, mut c14, mut c15) = (z, z, z, z, z, z, z, z);
    if n == 0 {
        return [z; 16];
    }
    let g0 = k as *const u8;
    // Without `next` (`v`), the prefetches ask for the first rows' lines again, in place.
    let (pf, pfs) = match next {
        Some(p) => (p as *const u8, 256usize),
        None => (g0, 0),
    };
    let (vp, vps) = match v {
        Some(p) => (p, 256usize),
        None => (g0, 0),
    };
    // SAFETY: the caller guarantees the rows and `qt`; prefetches never fault.
    std::arch::asm!(
        "2:",
        "prefetcht0 [{pf}]",
        "prefetcht0 [{pf} + 64]",
        "prefetcht0 [{pf} + 128]",
        "prefetcht0 [{pf} + 192]",
        "prefetcht1 [{vp}]",
        "prefetcht1 [{vp} + 64]",
        "prefetcht1 [{vp} + 128]",
        "prefetcht1 [{vp} + 192]",
        lanes_step!("0", "0"),
        lanes_step!("64", "4"),
        lanes_step!("128", "8"),
        lanes_step!("192", "12"),
        "add {g0}, 16",
        "add {g1}, 16",
        "add {g2}, 16",
        "add {g3}, 16",
        "add {qt}, 256",
        "add {pf}, {pfs}",
        "add {vp}, {vps}",
        "dec {n}",
        "jnz 2b",
        g0 = inout(reg) g0 => _,
        g1 = inout(reg) g0.add(4 * l) => _,
        g2 = inout(reg) g0.add(8 * l) => _,
        g3 = inout(reg) g0.add(12 * l) => _,
        l = in(reg) l,
        l3 = in(reg) 3 * l,
        qt = inout(reg) qt => _,
        pf = inout(reg) pf => _,
        pfs = in(reg) pfs,
        vp = inout(reg) vp => _,
        vps = in(reg) vps,
        n = inout(reg) n => _,
        out("zmm16") _,
        inout("zmm0") c0, inout("zmm1") c1, inout("zmm2") c2, inout("zmm3") c3,
        inout("zmm4") c4, inout("zmm5") c5, inout("zmm6") c6, inout("zmm7") c7,
        inout("zmm8") c8, inout("zmm9") c9, inout("zmm10") c10, inout("zmm11") c11,
        inout("zmm12") c12, inout("zmm13") c13, inout("zmm14") c14, inout("zmm15") c15,
        options(nostack, readonly),
    );
    [
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
    ]
}

/// `(Q strip rows, K base, K row stride, key count, score rows, score row stride, what
/// to ask for ahead, V rows to ask for into the L2)`.
type DotArgs = (
    *const f32,
    *const u8,
    usize,
    usize,
    *mut f32,
    usize,
    Ahead,
    Option<AskRows>,
);

/// [`qk_dot_impl`] for `R` rows of `e = 16·EQ` elements, the first `QR` of them held in
/// registers (`QR·EQ ≤ 16` vectors) and the others read from L1 by their FMAs: per key,
/// `EQ` K loads (bf16: `EQ / 2` split loads) and `R·EQ` FMAs. One strip of up to 8 rows
/// reads each K row once, where strips of only the rows whose Q fits in registers read
/// it once per strip. Measured on the Intel Xeon VM (one thread, f32, 64 keys of 128
/// elements in L1, best of five): 2.99 ns per key and row with 8 rows against 4.70
/// with 2 (kernel notes, "Score strips of up to 8 rows"). With V rows, each key's V row
/// is asked for into the L2 as its K row is read ([`V_ASK_MIN_EV_STRIPS`]).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_rows_strip_reg<const T: u8, const R: usize, const QR: usize, const EQ: usize>(
    (qs, k, ldk, nk, s, lds, ahead, vrows): DotArgs,
) {
    debug_assert!(QR <= R && QR * EQ <= 16);
    let mut qv = [[_mm512_setzero_ps(); EQ]; QR];
    for (r, row) in qv.iter_mut().enumerate() {
        for (i, x) in row.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(qs.add(r * EQ * 16 + i * 16));
        }
    }
    // Row `r`'s Q vector `i`: a register for the first `QR` rows, else read from L1.
    let qat = |qv: &[[__m512; EQ]; QR], r: usize, i: usize| {
        if r < QR {
            qv[r][i]
        } else {
            _mm512_loadu_ps(qs.add(r * EQ * 16 + i * 16))
        }
    };
    // Partial sums of 16 keys per row, unless `per_key_sums` (at a tail, the lanes past
    // `cnt` reduce stale sums from the previous 16 keys, which the masked store drops).
    let mut part = [[_mm512_setzero_ps(); 16]; R];
    let size = elem_bytes::<T>();
    // Rows of at most 256 elements: the row ahead is asked for whole in either mode.
    let skip = ahead.row_offset(ldk, size);
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(16);
        let key = |c: usize| {
            let kr = (j + c) * ldk;
            if let Some(v) = vrows {
                v.ask(j + c, 1);
            }
            if skip > 0 {
                prefetch_bytes(k.wrapping_add(kr * size + skip), EQ * 16 * size);
            }
            let mut acc = [_mm512_setzero_ps(); R];
            let mut i = 0;
            while i < EQ {
                if T == BF16 && i + 1 < EQ {
                    let (k0, k1) = load32_bf16_split((k as *const u16).add(kr + i * 16));
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(qat(&qv, r, i + 1), k1, _mm512_fmadd_ps(qat(&qv, r, i), k0, *a));
                    }
                    i += 2;
                } else {
                    let kv = load16::<T>(k, kr + i * 16);
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(qat(&qv, r, i), kv, *a);
                    }
                    i += 1;
                }
            }
            acc
        };
        if per_key_sums::<T>(R) {
            for c in 0..cnt {
                store_key_sums(key(c), s.add(j + c), lds);
            }
        } else {
            for c in 0..cnt {
                for (p, a) in part.iter_mut().zip(key(c)) {
                    p[c] = a;
                }
            }
            for (r, p) in part.iter().enumerate() {
                _mm512_mask_storeu_ps(s.add(r * lds + j), tail_mask_full(cnt), reduce16(*p));
            }
        }
        j += 16;
    }
}

/// [`qk_dot_impl`] for `R` rows: per key, one pass over its row (e/16 loads, shared by
/// the `R` rows); the partial sums of 16 keys are reduced together ([`reduce16`]), or
/// each key's at once where [`per_key_sums`].
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn qk_rows_strip<const T: u8, const R: usize>(
    qs: *const f32,
    e: usize,
    (k, ldk, nk, ahead): (*const u8, usize, usize, Ahead),
    s: *mut f32,
    lds: usize,
) {
    let full = e / 16 * 16;
    let tm = tail_mask(e - full);
    // Partial sums of 16 keys per row, unless `per_key_sums` (at a tail, the lanes past
    // `cnt` reduce stale sums from the previous 16 keys, which the masked store drops).
    let mut part = [[_mm512_setzero_ps(); 16]; R];
    let size = elem_bytes::<T>();
    // `Keys`: the whole row ahead, once per row; `Bytes`: one line per 64 bytes read,
    // spread over the row (a whole long row at once took more time than none; kernel
    // notes).
    let (row, line) = match ahead {
        Ahead::Keys(_) => (ahead.row_offset(ldk, size), 0),
        Ahead::Bytes(n) => (0, n),
        Ahead::Off => (0, 0),
    };
    let mut j = 0;
    while j < nk {
        let cnt = (nk - j).min(16);
        for c in 0..cnt {
            let kr = (j + c) * ldk;
            if row > 0 {
                prefetch_bytes(k.wrapping_add(kr * size + row), e * size);
            }
            let mut acc = [_mm512_setzero_ps(); R];
            let mut x = 0;
            if T == BF16 {
                while x + 32 <= e {
                    if line > 0 {
                        prefetch_bytes(k.wrapping_add((kr + x) * size + line), 64);
                    }
                    let (k0, k1) = load32_bf16_split((k as *const u16).add(kr + x));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let qr = qs.add(r * e + x);
                        *a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(qr.add(16)),
                            k1,
                            _mm512_fmadd_ps(_mm512_loadu_ps(qr), k0, *a),
                        );
                    }
                    x += 32;
                }
            }
            while x < full {
                if line > 0 && (x * size).is_multiple_of(64) {
                    prefetch_bytes(k.wrapping_add((kr + x) * size + line), 64);
                }
                let kv = load16::<T>(k, kr + x);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(qs.add(r * e + x)), kv, *a);
                }
                x += 16;
            }
            if full < e && T == F32 {
                let kv = _mm512_maskz_loadu_ps(tm, (k as *const f32).add(kr + full));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tm, qs.add(r * e + full)), kv, *a);
                }
            }
            if per_key_sums::<T>(R) {
                store_key_sums(acc, s.add(j + c), lds);
            } else {
                for (p, a) in part.iter_mut().zip(acc) {
                    p[c] = a;
                }
            }
        }
        if !per_key_sums::<T>(R) {
            for (r, p) in part.iter().enumerate() {
                _mm512_mask_storeu_ps(s.add(r * lds + j), tail_mask_full(cnt), reduce16(*p));
            }
        }
        j += 16;
    }
}

/// The fewest live f32 rows whose `P·V` ([`pv_rows`]) takes its V rows in chunks of 4
/// panels (tiles of up to 6 rows × 64 columns) where `nvp ≤ 8`. With whole rows of 8
/// panels (Ev = 128) the tiles hold 2 rows, so each V row of a decode block was read
/// `⌈live / 2⌉` times, with 8 loads and 2 broadcasts for every 16 FMAs; in chunks of 4
/// panels it is read `⌈live / 6⌉` times, with 4 loads and 6 broadcasts for 24 FMAs, and
/// each output is the same chain of FMAs as before (the same bits). On the Zen 4 VM,
/// both threads, f32 `1,Hq,8,L,S,128`, time chunked / whole (in-process probe, 16
/// pairs): Llama 3 8B's heads with 4 speculative tokens over 2048 keys 0.934, 16 rows
/// over 1024 keys 0.931, 32 rows over 2048 0.955, 48 rows 0.902, and 0.915–0.999 for 12
/// to 48 rows in earlier readings. With K/V from DRAM (67–134 MB) the readings spread
/// more, 0.915–1.081 over 10 of them, median about 0.96. From 4 to 11 rows the readings
/// went both ways (8 rows from DRAM 1.241, 11 rows 0.940), and on the Intel VM chunks
/// were slower from DRAM at 3–8 rows, so those keep whole rows (kernel notes, "`P·V`
/// of 12 to 48 decode rows in 6-row tiles"). Not measured on CPUs with full-width
/// 512-bit FMAs (Intel's server cores, Zen 5).
const PV_CHUNKS_MIN_ROWS_F32: usize = 12;

/// The most panels of a chunk of [`pv_rows`] (16, 8, 4, 2 or 1 at a time, even starts,
/// so that bf16 pairs stay whole): see there.
fn pv_chunk_cap<const T: u8>(live: usize, nvp: usize) -> usize {
    match live {
        _ if T == F32 && nvp <= 8 && live < PV_CHUNKS_MIN_ROWS_F32 => 16,
        0 | 1 => 16,
        2 => 8,
        _ => 4,
    }
}

/// How many keys [`pv_rows`] takes at a time, all its panel chunks over them before the
/// next keys: [`PV_HALF_SUB_KEYS`] for half-precision V rows of 2 to
/// [`PV_HALF_SUB_MAX_ROWS`] live rows whose rows the chunks split, else all `nk` (at
/// least 1, so that `nk = 0` still scales the output by `α`).
fn pv_key_step<const T: u8>(live: usize, nvp: usize, nk: usize) -> usize {
    if T != F32 && (2..=PV_HALF_SUB_MAX_ROWS).contains(&live) && nvp > pv_chunk_cap::<T>(live, nvp) {
        PV_HALF_SUB_KEYS
    } else {
        nk.max(1)
    }
}

/// Most live rows for which [`pv_key_step`] takes half-precision V rows in parts of
/// [`PV_HALF_SUB_KEYS`] keys.
const PV_HALF_SUB_MAX_ROWS: usize = 5;

/// Keys per part of a half-precision `P·V` of a few rows whose panel chunks split the V
/// rows ([`pv_key_step`]). In one pass over all keys of a decode block (up to 512), each
/// chunk read its columns of every V row (a quarter or half of each) before the next
/// chunk began, so each row was fetched from memory in pieces far apart in time; f32 rows
/// are asked for into the L2 by the scores ([`V_ASK_MIN_EV_LANES`]), half-precision rows
/// are not (it did not pay). In parts of 32 keys, all chunks of a part read its rows
/// while they are in the L1. On the Zen 4 VM (both threads, in-process probe, time in
/// parts over time in one pass, 12–16 pairs, outputs the same bits), from DRAM: f16 4
/// rows (`4,32,8,1,4096,128`) 0.706–0.944, 2 rows of 256 0.726–0.790; bf16 2 rows of
/// 256 0.863–0.948, and without AVX512-BF16 (which takes bf16 groups of 3 rows or more
/// elsewhere) 4 rows 0.930. With K/V in the L3 or about its size: f16 3 rows
/// 0.847–0.867, 4 rows 0.914–1.016, 5 rows 0.947, but 2 rows of 256 0.979–1.098; bf16 2
/// rows of 256 1.005–1.047, and without AVX512-BF16 3 rows 0.877 (a model's layers
/// stream their caches from DRAM). 6 to 16 f16 rows read 0.996–1.048, and f32 rows
/// (whose V rows the scores ask for) 0.984–1.053, so those keep one pass (kernel notes,
/// "Half-precision `P·V` of a few rows in parts of 32 keys").
const PV_HALF_SUB_KEYS: usize = 32;

/// Decode `O = α·O + P·V` for the first `live` rows that walks each V row to its end
/// before the next, keys in order (see [`qk_dot_impl`] for why): P `live × nk` with row
/// stride `ldp ≥ nk`; V row `j` at element `j·ldv` of `v` (f32, or half precision read in
/// place and widened in registers); `nvp` 16-column output panels; `o` with row stride
/// `ldo`; each tile asks for its columns of the V row `ahead` keys on (0: nothing; a
/// hint, results do not depend on it). Tiles of `R` rows × `N` panels (`R·N ≤ 24`
/// accumulators) each run over all keys; where one tile spans every panel (`nvp` of 1,
/// 2, 4, 8 or 16), the first tile reads the block's V rows in memory order and the later
/// tiles find them in cache.
/// Chunks of panels are capped so that tiles hold more rows: at 8 panels for 2 live
/// rows and at 4 for 3 or more, except for f32 rows with `nvp ≤ 8` and fewer than
/// [`PV_CHUNKS_MIN_ROWS_F32`] live rows, whose chunks stay whole (from DRAM, f32 rows of
/// 3–8 live rows read in 4-panel chunks ran up to 16% slower on the Intel VM; kernel
/// notes, "`P·V` tiles of more rows"). Half-precision rows of 2 to
/// [`PV_HALF_SUB_MAX_ROWS`] live rows whose chunks split the V rows run all chunks over
/// [`PV_HALF_SUB_KEYS`] keys at a time ([`pv_key_step`]).
/// For bf16 rows, the output columns of each whole panel pair (`2m`, `2m + 1 < nvp`)
/// come out in the split layout of [`split_pairs`]: the caller applies
/// [`merge_pairs`] once all keys are in.
///
/// `next_k`: the next block's K rows, for the tiles to ask for into the L2 as they run,
/// where the rows follow each other (a hint: results do not depend on it). The decode
/// driver passes them where the block's scores asked for its V rows ([`qk_dot_raw`]
/// returned `true`): then the scores stream this block's V rows and `P·V` the next
/// block's K rows, where before the scores streamed both and `P·V` nothing, with the
/// memory idle while its FMAs ran. The lines are shared out evenly among the tiles, at
/// most two per key of each (eight per pass of the assembly loop,
/// `rows_loop_6x4_in_rows_ask`). On the Zen 4 VM (both threads, f32 `B,Hq,8,L,4096,128`
/// with B = 4, K/V of 134 MB from DRAM, in-process probe, time asking over time not,
/// 16 pairs, outputs the same bits): 7 rows per group 0.923, 8 rows 0.895, 9 rows
/// 0.953, 10 rows 0.958, 11 rows 0.962, 12 rows 0.867, 16 rows 0.884, 32 rows 0.965,
/// 48 rows 0.949; Gemma's rows of 256 (`4,16,8,2,4096,256`) 0.863 and 1 row 0.998; with
/// K/V in the L3, 0.966–1.061. Where the scores do not ask for V (rows of 64 or 96, 1–2
/// rows of 128, half precision) `P·V` does not ask either; tried there, it made no
/// difference or slowed (f16 `decode_b4` 1.128; kernel notes, "`P·V` asks for the next
/// block's K rows"). For 3–6 rows of 128, see [`V_ASK_MIN_ROWS_128`].
///
/// # Safety
/// AVX-512F must be available.
#[allow(clippy::too_many_arguments)]
pub(in crate::kernels::cpu) unsafe fn pv_rows(
    (p, ldp): (&[f32], usize),
    live: usize,
    nk: usize,
    v: Data,
    (ldv, nvp, ahead): (usize, usize, usize),
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
    next_k: Option<AskRows>,
) {
    let (ptr, len) = data_ptr(v);
    assert!(ldp >= nk && ldo >= nvp * NR && alpha.len() >= live);
    assert!(live == 0 || p.len() >= (live - 1) * ldp + nk);
    assert!(nvp == 0 || nk == 0 || len >= (nk - 1) * ldv + nvp * NR);
    assert!(live == 0 || o.len() >= (live - 1) * ldo + nvp * NR);
    let (pp, op, al) = (p.as_ptr(), o.as_mut_ptr(), alpha.as_ptr());
    // SAFETY: bounds asserted above; features guaranteed by the caller.
    unsafe {
        match v {
            Data::F32(_) => {
                pv_rows_impl::<F32>((pp, ldp), (live, nk), ptr, (ldv, nvp, ahead), op, ldo, al, next_k)
            }
            Data::BF16(_) => {
                pv_rows_impl::<BF16>((pp, ldp), (live, nk), ptr, (ldv, nvp, ahead), op, ldo, al, next_k)
            }
            Data::F16(_) => {
                pv_rows_impl::<F16>((pp, ldp), (live, nk), ptr, (ldv, nvp, ahead), op, ldo, al, next_k)
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn pv_rows_impl<const T: u8>(
    (p, ldp): (*const f32, usize),
    (live, nk): (usize, usize),
    v: *const u8,
    (ldv, nvp, ahead): (usize, usize, usize),
    o: *mut f32,
    ldo: usize,
    alpha: *const f32,
    next_k: Option<AskRows>,
) {
    let cap = pv_chunk_cap::<T>(live, nvp);
    // The next block's K rows, asked for line by line where they follow each other.
    let mut ask = Lines::of(next_k);
    // The keys in parts of `step`, all chunks of each part in turn (see
    // `PV_HALF_SUB_KEYS`); each output is the same chain of FMAs as in one pass, the later
    // parts starting from the stored outputs times 1.
    let step = pv_key_step::<T>(live, nvp, nk);
    // (Read as `α` by the later parts only, which only rows of up to
    // `PV_HALF_SUB_MAX_ROWS` take.)
    let ones = [1f32; PV_HALF_SUB_MAX_ROWS];
    debug_assert!(step >= nk || live <= PV_HALF_SUB_MAX_ROWS);
    let size = elem_bytes::<T>();
    let mut j0 = 0;
    loop {
        let cnt = (nk - j0).min(step);
        let al = if j0 == 0 { alpha } else { ones.as_ptr() };
        let (pj, vj) = (p.add(j0), v.add(j0 * ldv * size));
        pv_chunks::<T>(
            (pj, ldp),
            (live, cnt),
            vj,
            (ldv, nvp, ahead),
            o,
            ldo,
            al,
            (cap, &mut ask),
        );
        j0 += cnt;
        if j0 >= nk {
            break;
        }
    }
}

/// The tiles of [`pv_chunks`] in order, `(first panel, panels, first row, rows)`:
/// chunks of up to `cap` panels (16, 8, 4, 2 or 1 at a time), each over the `live` rows
/// in tiles of 1 row (16 panels), up to 2 (8), up to 6 (4), else 6, 3, 2 or 1.
fn pv_tiles(live: usize, nvp: usize, cap: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let mut n0 = 0;
    std::iter::from_fn(move || {
        (n0 < nvp).then(|| {
            let n = [16, 8, 4, 2, 1]
                .into_iter()
                .find(|&c| c <= (nvp - n0).min(cap))
                .unwrap_or(1);
            let mut r0 = 0;
            let chunk = n0;
            n0 += n;
            std::iter::from_fn(move || {
                (r0 < live).then(|| {
                    let rem = live - r0;
                    let r = match n {
                        16 => 1,
                        8 => rem.min(2),
                        4 => rem.min(6),
                        _ => [6, 3, 2, 1].into_iter().find(|&x| x <= rem).unwrap_or(1),
                    };
                    r0 += r;
                    (chunk, n, r0 - r, r)
                })
            })
        })
    })
    .flatten()
}

/// [`pv_rows_impl`] for keys `0..nk`: the tiles of [`pv_tiles`] in turn. `ask`: lines
/// to ask for into the L2, shared out evenly among the tiles, at most two per key of
/// each ([`PvSrc::ask`]); on return, the lines not asked for.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pv_chunks<const T: u8>(
    (p, ldp): (*const f32, usize),
    (live, nk): (usize, usize),
    v: *const u8,
    (ldv, nvp, ahead): (usize, usize, usize),
    o: *mut f32,
    ldo: usize,
    alpha: *const f32,
    (cap, ask): (usize, &mut Lines),
) {
    let share = if ask.left > 0 {
        ask.left.div_ceil(pv_tiles(live, nvp, cap).count().max(1))
    } else {
        0
    };
    for (n0, n, r0, r) in pv_tiles(live, nvp, cap) {
        let mine = ask.take(share.min(2 * nk));
        let src = PvSrc {
            p: p.add(r0 * ldp),
            ldp,
            segs: [(v, nk), (std::ptr::null(), 0)],
            vps: NR,
            ldv,
            ahead,
            ask: mine,
        };
        let (v0, op, al) = (n0 * NR, o.add(r0 * ldo + n0 * NR), alpha.add(r0));
        match (n, r) {
            (16, _) => pv_tile::<1, 16, T, 1>(src, v0, op, ldo, al),
            (8, 1) => pv_tile::<1, 8, T, 1>(src, v0, op, ldo, al),
            (8, _) => pv_tile::<2, 8, T, 1>(src, v0, op, ldo, al),
            (4, 1) => pv_tile::<1, 4, T, 1>(src, v0, op, ldo, al),
            (4, 2) => pv_tile::<2, 4, T, 1>(src, v0, op, ldo, al),
            (4, 3) => pv_tile::<3, 4, T, 1>(src, v0, op, ldo, al),
            (4, 4) => pv_tile::<4, 4, T, 1>(src, v0, op, ldo, al),
            (4, 5) => pv_tile::<5, 4, T, 1>(src, v0, op, ldo, al),
            (4, _) => pv_tile::<6, 4, T, 1>(src, v0, op, ldo, al),
            (2, 1) => pv_tile::<1, 2, T, 1>(src, v0, op, ldo, al),
            (2, 2) => pv_tile::<2, 2, T, 1>(src, v0, op, ldo, al),
            (2, 3) => pv_tile::<3, 2, T, 1>(src, v0, op, ldo, al),
            (2, _) => pv_tile::<6, 2, T, 1>(src, v0, op, ldo, al),
            (_, 1) => pv_tile::<1, 1, T, 1>(src, v0, op, ldo, al),
            (_, 2) => pv_tile::<2, 1, T, 1>(src, v0, op, ldo, al),
            (_, 3) => pv_tile::<3, 1, T, 1>(src, v0, op, ldo, al),
            (_, _) => pv_tile::<6, 1, T, 1>(src, v0, op, ldo, al),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether row `r` of `live` falls in a strip with the rows in the lanes, of 16 or
    /// of 8 (f32 rows of a multiple of 16 up to 256): `qk_dot_impl`'s choice of strips.
    fn in_lanes(live: usize, e: usize, r: usize) -> bool {
        let mut r0 = 0;
        while r0 < live {
            let rem = live - r0;
            let (n, lanes) = if rem >= LANES_MIN_ROWS {
                (rem.min(16), true)
            } else if rem >= LANES8_MIN_ROWS && lanes8() {
                (rem.min(8), true)
            } else {
                let n = match e {
                    64 | 128 => rem.min(8),
                    256 => rem.min(4),
                    _ => rem.min(MR),
                };
                (n, false)
            };
            if r < r0 + n {
                return lanes;
            }
            r0 += n;
        }
        false
    }

    /// `pv_chunks` with `pv_rows`' chunks over all `nk` keys in one pass; returns the key
    /// step that `pv_rows` takes for the same call.
    ///
    /// # Safety
    /// AVX-512F must be available; operands as for `pv_rows`.
    unsafe fn one_pass<const T: u8>(
        p: (*const f32, usize),
        (live, nk): (usize, usize),
        v: *const u8,
        (ldv, nvp): (usize, usize),
        (o, ldo): (*mut f32, usize),
        alpha: *const f32,
    ) -> usize {
        let cap = pv_chunk_cap::<T>(live, nvp);
        let mut none = Lines::NONE;
        // SAFETY: as the caller guarantees.
        unsafe { pv_chunks::<T>(p, (live, nk), v, (ldv, nvp, 0), o, ldo, alpha, (cap, &mut none)) };
        pv_key_step::<T>(live, nvp, nk)
    }

    /// `pv_rows` over half-precision V rows in parts of `PV_HALF_SUB_KEYS` keys gives the
    /// same bits as one pass over all keys (`pv_chunks` with the same chunks), with
    /// `α ≠ 1` (applied once), key counts around the part size, V rows of 128 and 256
    /// elements with and without room after each, and 1–6 live rows (the parts run for
    /// 2–5: checked, so that the comparison is not of a path with itself); f16 also
    /// against f64.
    #[test]
    fn half_precision_values_in_key_parts_equal_one_pass() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("note: no AVX-512F on this machine; decode values not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        let mut parts_seen = 0;
        for (nvp, ldv) in [(8usize, 128usize), (16, 256), (8, 144), (16, 272)] {
            for nk in [5usize, 31, 32, 33, 64, 100] {
                let vf: Vec<f32> = (0..nk * ldv).map(|i| val(i, 5)).collect();
                let vh: Vec<half::f16> = vf.iter().map(|&x| half::f16::from_f32(x)).collect();
                let vb: Vec<half::bf16> = vf.iter().map(|&x| half::bf16::from_f32(x)).collect();
                for live in 1..=6usize {
                    let (ldp, ldo) = (nk + 3, nvp * NR + 16);
                    let p: Vec<f32> = (0..live * ldp).map(|i| val(i, 7).abs()).collect();
                    let alpha: Vec<f32> = (0..live).map(|r| if r % 2 == 1 { 0.75 } else { 1.0 }).collect();
                    let o0: Vec<f32> = (0..live * ldo).map(|i| val(i, 13)).collect();
                    for (d, f16) in [(Data::F16(&vh), true), (Data::BF16(&vb), false)] {
                        let (mut a, mut b) = (o0.clone(), o0.clone());
                        let (pp, vp, al) = (p.as_ptr(), data_ptr(d).0, alpha.as_ptr());
                        // SAFETY: AVX-512F detected above; P, V and O as `pv_rows` requires.
                        unsafe {
                            pv_rows((&p, ldp), live, nk, d, (ldv, nvp, 0), &mut a, ldo, &alpha, None);
                            let (args, ob) = ((pp, ldp), (b.as_mut_ptr(), ldo));
                            let step = if f16 {
                                one_pass::<F16>(args, (live, nk), vp, (ldv, nvp), ob, al)
                            } else {
                                one_pass::<BF16>(args, (live, nk), vp, (ldv, nvp), ob, al)
                            };
                            // Parts where the chunks split the rows: 3–5 rows (4-panel
                            // chunks), 2 rows of 16 panels (8-panel chunks).
                            let split = match live {
                                2 => nvp > 8,
                                3..=5 => true,
                                _ => false,
                            };
                            assert_eq!(
                                step < nk,
                                split && nk > PV_HALF_SUB_KEYS,
                                "live {live}, nvp {nvp}"
                            );
                            parts_seen += usize::from(step < nk);
                        }
                        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "nvp {nvp}, ldv {ldv}, nk {nk}, live {live}, f16 {f16}");
                        if f16 {
                            for r in 0..live {
                                for c in 0..nvp * NR {
                                    let dot: f64 = (0..nk)
                                        .map(|j| p[r * ldp + j] as f64 * vh[j * ldv + c].to_f64())
                                        .sum();
                                    let want = alpha[r] as f64 * o0[r * ldo + c] as f64 + dot;
                                    let got = a[r * ldo + c] as f64;
                                    assert!(
                                        (got - want).abs() <= 1e-4,
                                        "row {r} col {c}: {got} against {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(parts_seen > 0);
    }

    /// `pv_rows` gives the same bits whether or not it asks for the next block's K rows
    /// (`next_k`): f32 V rows read in place with 1–24 live rows (the 6-row assembly tiles,
    /// which then run their first keys in the loop that asks and the rest in the one that
    /// does not, and the intrinsics tiles), 4, 8 and 16 panels, key counts on both sides
    /// of the four-key passes, and next blocks of fewer lines than the tiles could ask
    /// for and of more (K rows that follow each other, and with a gap, which asks
    /// nothing). `pv_chunks` then leaves no line of a next block unasked where its tiles
    /// could ask for all (two per key), and otherwise all but the excess, the address
    /// moved past the lines asked for.
    #[test]
    fn p_v_asks_for_the_next_k_rows_without_changing_the_output() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("note: no AVX-512F on this machine; decode values not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        let mut split_seen = false;
        for nvp in [4usize, 8, 16] {
            let ldv = nvp * NR;
            for nk in [1usize, 3, 4, 5, 9, 33, 64, 130] {
                let v: Vec<f32> = (0..nk * ldv).map(|i| val(i, 5)).collect();
                for live in [1usize, 2, 3, 5, 6, 7, 8, 11, 12, 13, 16, 24] {
                    let (ldp, ldo) = (nk + 3, ldv + 16);
                    let p: Vec<f32> = (0..live * ldp).map(|i| val(i, 7).abs()).collect();
                    let alpha: Vec<f32> = (0..live).map(|r| if r % 2 == 1 { 0.75 } else { 1.0 }).collect();
                    let o0: Vec<f32> = (0..live * ldo).map(|i| val(i, 13)).collect();
                    let cap = pv_chunk_cap::<F32>(live, nvp);
                    let tiles = pv_tiles(live, nvp, cap).count();
                    // Next blocks of a quarter of what the tiles can ask for, and of twice.
                    for (e, nk1, gap) in [
                        (128usize, (nk * tiles / 8).max(1), 0usize),
                        (128, nk * tiles, 0),
                        (64, 7, 16),
                    ] {
                        let ldk = e + gap;
                        let k: Vec<f32> = vec![0.5; nk1 * ldk];
                        let next = AskRows::new(Data::F32(&k), ldk, e, nk1);
                        let (mut a, mut b) = (o0.clone(), o0.clone());
                        let d = Data::F32(&v);
                        // SAFETY: AVX-512F detected above; P, V and O as `pv_rows` requires.
                        unsafe {
                            pv_rows((&p, ldp), live, nk, d, (ldv, nvp, 0), &mut a, ldo, &alpha, None);
                            pv_rows(
                                (&p, ldp),
                                live,
                                nk,
                                d,
                                (ldv, nvp, 0),
                                &mut b,
                                ldo,
                                &alpha,
                                Some(next),
                            );
                        }
                        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(
                            same,
                            "nvp {nvp}, nk {nk}, live {live}, next {nk1} rows of {e}: outputs changed"
                        );
                        // The lines that one pass of the tiles leaves unasked.
                        let mut ask = Lines::of(Some(next));
                        let (start, lines) = (ask.at, ask.left);
                        assert_eq!(lines > 0, gap == 0);
                        let mut c = o0.clone();
                        // SAFETY: as above.
                        unsafe {
                            pv_chunks::<F32>(
                                (p.as_ptr(), ldp),
                                (live, nk),
                                data_ptr(d).0,
                                (ldv, nvp, 0),
                                c.as_mut_ptr(),
                                ldo,
                                alpha.as_ptr(),
                                (cap, &mut ask),
                            )
                        };
                        let room = 2 * nk * tiles;
                        let left = if lines.div_ceil(tiles) <= 2 * nk {
                            0
                        } else {
                            lines - room.min(lines)
                        };
                        assert_eq!(ask.left, left, "nvp {nvp}, nk {nk}, live {live}, {lines} lines");
                        assert_eq!(ask.at, start.wrapping_add(64 * (lines - left)));
                        split_seen |=
                            cap == 4 && live >= MR && lines > 0 && (lines / tiles).div_ceil(8) * 4 < nk;
                    }
                }
            }
        }
        assert!(split_seen, "no 6-row tile asked for fewer keys than it ran");
    }

    /// `qk_dot_raw` asks for the V rows exactly where its rule says (f32 K rows; a first
    /// strip with the rows in the lanes and V rows of `V_ASK_MIN_EV_LANES` or more, or a
    /// first register strip and V rows of `V_ASK_MIN_EV_STRIPS` or more, or of 128 or
    /// more with `V_ASK_MIN_ROWS_128` rows or more: 2 and 3 rows either side), says so, and
    /// asking changes no score: every kind of first strip (1–48 rows; head sizes with
    /// register strips and one without), V rows that follow each other and are as long
    /// as the K rows (asked for line by line in the lanes' loop), shorter and longer
    /// ones, rows with a gap, and f16/bf16 K rows, which ask for nothing.
    #[test]
    fn decode_scores_ask_for_v_rows_where_the_rule_says_without_changing_them() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("note: no AVX-512F on this machine; decode scores not exercised");
            return;
        }
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        let nk = 69;
        for (e, ev, ldv) in [
            (128usize, 128usize, 128usize),
            (256, 256, 256),
            (64, 256, 272),
            (256, 128, 144),
            (64, 64, 64),
            (128, 96, 96),
            (80, 256, 256),
            (64, 128, 128),
        ] {
            let k: Vec<f32> = (0..nk * e).map(|i| val(i, 3)).collect();
            let kb: Vec<half::bf16> = k.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let kh: Vec<half::f16> = k.iter().map(|&x| half::f16::from_f32(x)).collect();
            let v: Vec<f32> = (0..nk * ldv).map(|i| val(i, 5)).collect();
            for live in [1usize, 2, 3, 4, 5, 7, 8, 11, 12, 16, 20, 32, 48] {
                let rows = live.div_ceil(MR) * MR;
                let q: Vec<f32> = (0..rows * e).map(|i| val(i, 11)).collect();
                // The first strip's kind, as `qk_dot_impl` picks it.
                let lanes =
                    lanes_head_size(e) && (live >= LANES_MIN_ROWS || (live >= LANES8_MIN_ROWS && lanes8()));
                let reg = !lanes && matches!(e, 64 | 128 | 256);
                for kd in [Data::F32(&k), Data::BF16(&kb), Data::F16(&kh)] {
                    let (mut s0, mut s1) = (vec![f32::NAN; rows * nk], vec![f32::NAN; rows * nk]);
                    let vd = Some((Data::F32(&v), ldv, ev));
                    // SAFETY: AVX-512F detected above; K, V and the scores as required.
                    let asked0 =
                        unsafe { qk_dot_raw(&q, rows, live, e, kd, (e, nk, Ahead::Off), &mut s0, nk, None) };
                    // SAFETY: as above.
                    let asked1 =
                        unsafe { qk_dot_raw(&q, rows, live, e, kd, (e, nk, Ahead::Off), &mut s1, nk, vd) };
                    assert!(!asked0);
                    let f32_k = matches!(kd, Data::F32(_));
                    // The first register strip's rows, as `qk_dot_impl` takes them.
                    let r = match e {
                        64 | 128 => live.min(8),
                        _ => live.min(4),
                    };
                    let reg_asks = ev >= V_ASK_MIN_EV_STRIPS || (r >= V_ASK_MIN_ROWS_128 && ev >= 128);
                    let want = f32_k && ((lanes && ev >= V_ASK_MIN_EV_LANES) || (reg && reg_asks));
                    assert_eq!(asked1, want, "e {e}, ev {ev}, live {live}, f32 K {f32_k}");
                    let same = s0.iter().zip(&s1).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "e {e}, ev {ev}, ldv {ldv}, live {live}: scores changed");
                }
            }
        }
    }

    /// `qk_dot_raw` against f64 dot products for every live row count of a decode group
    /// (1..=48, so every score strip and its dispatch arm, f32 strips of one and two rows
    /// taking each key's sums at once, `per_key_sums`, and f32 strips of 12 to 16 rows in
    /// the lanes, `qk_lanes`, and on the CPUs of `lanes8` of 7 to 8 rows in the lanes of
    /// the AVX2 strips, alone and after others), at the head sizes with register
    /// strips (64, 128, 256) and one without (80), for f32, bf16 and f16 K rows (read in
    /// place; bf16 with Q in the split layout), over 70 keys (a tail of 6 after 64), with
    /// K rows that follow each other and rows 16 elements apart (f32). Padding rows must
    /// get zero scores.
    #[test]
    fn decode_scores_match_f64_for_every_strip() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("note: no AVX-512F on this machine; decode scores not exercised");
            return;
        }
        let nk = 70usize;
        let val = |i: usize, m: usize| ((i * 37 + m) % 101) as f32 / 50.0 - 1.0;
        for e in [64usize, 128, 256, 80] {
            let kf: Vec<f32> = (0..nk * e).map(|i| val(i, 3)).collect();
            let kb: Vec<half::bf16> = kf.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let kh: Vec<half::f16> = kf.iter().map(|&x| half::f16::from_f32(x)).collect();
            // The f32 rows again, 16 elements apart (NaN between them).
            let ldw = e + 16;
            let mut kwide = vec![f32::NAN; nk * ldw];
            for (w, r) in kwide.chunks_exact_mut(ldw).zip(kf.chunks_exact(e)) {
                w[..e].copy_from_slice(r);
            }
            for live in 1..=48usize {
                let rows = live.div_ceil(MR) * MR;
                // Score rows with room after each, and rows that follow each other.
                let lds = if live % 2 == 0 { 80 } else { nk };
                let q: Vec<f32> = (0..rows * e).map(|i| val(i, 11)).collect();
                // (Every head size here is a multiple of 16, as half-precision rows need.)
                for dt in 0..4 {
                    // The K rows each dtype reads, widened exactly, for the reference.
                    let kw: Vec<f64> = match dt {
                        0 | 3 => kf.iter().map(|&x| x as f64).collect(),
                        1 => kb.iter().map(|x| x.to_f64()).collect(),
                        _ => kh.iter().map(|x| x.to_f64()).collect(),
                    };
                    let mut qk = q.clone();
                    if dt == 1 {
                        for row in qk.chunks_exact_mut(e) {
                            split_pairs(row);
                        }
                    }
                    let mut s = vec![f32::NAN; rows * lds];
                    let (k, ldk) = match dt {
                        0 => (Data::F32(&kf), e),
                        1 => (Data::BF16(&kb), e),
                        2 => (Data::F16(&kh), e),
                        _ => (Data::F32(&kwide), ldw),
                    };
                    // Asking for nothing ahead, for rows ahead, and for lines ahead (past
                    // the last key too).
                    let ahead = [Ahead::Off, Ahead::Keys(8), Ahead::Bytes(256)][live % 3];
                    // SAFETY: AVX-512F detected above.
                    unsafe { qk_dot_raw(&qk, rows, live, e, k, (ldk, nk, ahead), &mut s, lds, None) };
                    for r in 0..rows {
                        for j in 0..nk {
                            let got = s[r * lds + j] as f64;
                            if r >= live {
                                assert_eq!(
                                    got, 0.0,
                                    "padding row {r} key {j} (e {e}, live {live}, dtype {dt})"
                                );
                                continue;
                            }
                            let (qr, kr) = (&q[r * e..(r + 1) * e], &kw[j * e..(j + 1) * e]);
                            let want: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum();
                            let mag: f64 = qr.iter().zip(kr).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                            // A strip in the lanes sums each score in one chain of `e`
                            // FMAs, as the prefill's tiles do: the bound of recursive
                            // summation, `e·u` of the magnitudes (u = 2⁻²⁴). The other
                            // strips sum in 16 lanes and a tree.
                            let bound = if dt != 1 && dt != 2 && in_lanes(live, e, r) && e % 16 == 0 {
                                e as f64 * f64::from(f32::EPSILON) / 2.0
                            } else {
                                1e-6
                            };
                            assert!(
                                (got - want).abs() <= bound * mag,
                                "row {r} key {j} (e {e}, live {live}, dtype {dt}): {got} against {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
