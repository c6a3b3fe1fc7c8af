//! Fresh buffers and transparent huge pages.
//!
//! - **Outputs.** glibc serves every allocation of [`HUGE_OUTPUT_BYTES`] (32 MiB, its
//!   largest dynamic mmap threshold) or more with a fresh mapping and unmaps it on free,
//!   so each call that returns such an output faults in all of it again. On the 2-core
//!   Zen 4 VM (transparent huge pages in `madvise` mode) the 32 MiB f32 output of
//!   `gpt2k_causal_d128` spent 17–20 ms of thread time in those faults, about 5% of the
//!   call's thread time (with the advice the call ran 2.6% faster). Smaller outputs are
//!   reused from the heap and did not fault (`long8k_causal`'s 16 MiB: under 2 ms of
//!   thread time, all of the stores included).
//! - **Attention outputs are faulted in first** ([`fault_in_fresh_output`]). Even on huge
//!   pages, faulting the output in before the blocks start measured faster than taking
//!   the faults while the blocks write it: on the same VM (2026-12-07, one process, the
//!   two ways alternating, medians of 12 pairs) calls with 32–64 MiB outputs took
//!   0.0–1.8% less time that way (`gpt2k_causal_d128`'s shape 1.3–3.1% less, in three
//!   runs); in an earlier run of 8 pairs, rows of 128 keys took 1.1–1.6% more. The
//!   faults themselves stay: in `bench`'s process, faulting in `gpt2k_causal_d128`'s
//!   32 MiB on both threads took 4.6–6.3 ms per call (48.7 ms on the first). Projection
//!   outputs are not faulted in first: a 32 MiB `Proj` output took 1–4% more time that
//!   way.
//! - **KV cache buffers** ([`zeroed`]). Decode streams the whole cache from DRAM at every
//!   step. On the same VM, `decode_b4`'s 268 MB of f32 K/V were read 6–14% faster from
//!   huge pages than from 4 KiB pages, and `decode_gqa`'s 33 MB 5–9% faster.
//!
//! The advice is a hint: where the kernel refuses it (huge pages off, not Linux) the
//! buffer is used as it is.
use candle::{DType, Device, Result, Shape, Tensor};
use half::vec::HalfBitsVecExt;

/// Outputs of at least this many bytes get the huge-page advice.
pub(crate) const HUGE_OUTPUT_BYTES: usize = 32 << 20;

/// The huge-page size the advice is aligned to.
const HUGE_PAGE: usize = 2 << 20;

/// The whole huge pages `[start, end)` inside the `len` bytes at address `addr`, or
/// `None` when there is none.
pub(crate) fn huge_page_span(addr: usize, len: usize) -> Option<(usize, usize)> {
    let start = addr.checked_add(HUGE_PAGE - 1)? & !(HUGE_PAGE - 1);
    let end = addr.checked_add(len)? & !(HUGE_PAGE - 1);
    (start < end).then_some((start, end))
}

/// Asks for huge pages on the whole 2 MiB pages of `buf` when it holds at least
/// [`HUGE_OUTPUT_BYTES`] and none of it has been written yet (a hint; nothing happens
/// off Linux or when the kernel declines).
pub(crate) fn advise_fresh_output<T>(buf: &mut [std::mem::MaybeUninit<T>]) {
    let len = std::mem::size_of_val(buf);
    if len >= HUGE_OUTPUT_BYTES {
        advise(buf.as_mut_ptr() as usize, len);
    }
}

/// [`advise_fresh_output`], then, for a buffer of at least [`HUGE_OUTPUT_BYTES`], faults
/// its whole 2 MiB pages in before anything is written, one page per work item, shared
/// among the threads ([`super::par::for_each_index`]). For the attention output (see
/// the module docs). Where the kernel refuses (before Linux 5.14) or off Linux, the
/// pages are faulted in when first written, as without it.
pub(crate) fn fault_in_fresh_output<T>(buf: &mut [std::mem::MaybeUninit<T>]) {
    advise_fresh_output(buf);
    let len = std::mem::size_of_val(buf);
    if len >= HUGE_OUTPUT_BYTES {
        populate(buf.as_mut_ptr() as usize, len);
    }
}

/// `MADV_POPULATE_WRITE` (Linux 5.14 and later; libc's constant is newer than the
/// oldest libc this crate accepts): fault pages in writable, as a write to each would,
/// without writing them. Older kernels refuse it with `EINVAL`.
#[cfg(target_os = "linux")]
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Faults in the whole 2 MiB pages of the `len` bytes at `addr` (one `madvise` per page,
/// the pages shared among the threads), leaving their contents as they are.
///
/// Callers hold those bytes mutably, so no other thread uses them.
#[cfg_attr(not(target_os = "linux"), allow(unused_variables))]
fn populate(addr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    if let Some((start, end)) = huge_page_span(addr, len) {
        super::par::for_each_index((end - start) / HUGE_PAGE, |i| {
            // SAFETY: the page lies inside a buffer that the caller holds mutably;
            // populating maps it in and never changes its contents. The result is
            // ignored: a refused request leaves the page to be faulted in when written.
            unsafe {
                libc::madvise(
                    (start + i * HUGE_PAGE) as *mut libc::c_void,
                    HUGE_PAGE,
                    MADV_POPULATE_WRITE,
                );
            }
        });
    }
}

/// KV cache buffers of at least this many bytes get the huge-page advice: two huge
/// pages, so that at least one whole one lies inside.
pub(crate) const HUGE_CACHE_BYTES: usize = 2 * HUGE_PAGE;

/// Asks for huge pages on the whole 2 MiB pages of the `len` bytes at `addr`.
///
/// Callers hold those bytes mutably (so no other thread uses them) and have not
/// written them since they were allocated.
#[cfg_attr(not(target_os = "linux"), allow(unused_variables))]
fn advise(addr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    if let Some((start, end)) = huge_page_span(addr, len) {
        // SAFETY: `[start, end)` lies inside a buffer that the caller holds mutably;
        // `MADV_HUGEPAGE` changes how its pages are faulted in, never their contents.
        // The result is ignored: the advice is only a hint.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// A zeroed `n`-element vector from the allocator's zeroing path, advised for huge
/// pages when it holds at least [`HUGE_CACHE_BYTES`].
///
/// A large zeroed allocation is a fresh mapping that nothing has touched, so the
/// advice decides how its pages are faulted in when they are first written, and they
/// are still faulted in lazily: memory is only committed where something is stored.
///
/// It asks `alloc_zeroed` directly, as `vec![0; n]` does for these types, so no page is
/// touched here; unlike `vec!`, a size the allocator cannot give is an error, not an abort.
fn zeroed_vec<T: ZeroBits>(n: usize) -> Result<Vec<T>> {
    let fail = || {
        candle::Error::Msg(format!(
            "cannot allocate {n} zeroed elements of {} bytes",
            std::mem::size_of::<T>()
        ))
    };
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| fail())?;
    let mut v = if layout.size() == 0 {
        Vec::new()
    } else {
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
        if ptr.is_null() {
            return Err(fail());
        }
        // SAFETY: `ptr` comes from the global allocator with the layout of `[T; n]`
        // (so capacity `n` matches its size and alignment), and its `n` elements are
        // initialised: all-zero bits are a valid `T` (`ZeroBits`).
        unsafe { Vec::from_raw_parts(ptr, n, n) }
    };
    let len = std::mem::size_of_val(v.as_slice());
    if len >= HUGE_CACHE_BYTES {
        advise(v.as_mut_ptr() as usize, len);
    }
    Ok(v)
}

/// Primitive types whose all-zero bit pattern is a valid value (their zero).
trait ZeroBits: Copy {}
impl ZeroBits for f32 {}
impl ZeroBits for f64 {}
impl ZeroBits for u8 {}
impl ZeroBits for u16 {}
impl ZeroBits for u32 {}
impl ZeroBits for i64 {}

/// A zeroed `shape` tensor for a buffer that is filled over time and read whole many
/// times, such as a KV cache.
///
/// On the CPU, for the float and integer dtypes, its memory comes from the allocator's
/// zeroing path and is advised for transparent huge pages when it holds at least
/// [`HUGE_CACHE_BYTES`] (see the module docs). Elsewhere this is [`Tensor::zeros`].
pub(crate) fn zeroed(shape: &Shape, dtype: DType, device: &Device) -> Result<Tensor> {
    if !device.is_cpu() {
        return Tensor::zeros(shape, dtype, device);
    }
    let n = shape.elem_count();
    match dtype {
        DType::F32 => Tensor::from_vec(zeroed_vec::<f32>(n)?, shape, device),
        DType::F64 => Tensor::from_vec(zeroed_vec::<f64>(n)?, shape, device),
        // The bits of +0.0 are all zero, so the zeroed `u16`s are the zeros of both.
        DType::F16 => Tensor::from_vec(
            zeroed_vec::<u16>(n)?.reinterpret_into::<half::f16>(),
            shape,
            device,
        ),
        DType::BF16 => Tensor::from_vec(
            zeroed_vec::<u16>(n)?.reinterpret_into::<half::bf16>(),
            shape,
            device,
        ),
        DType::U8 => Tensor::from_vec(zeroed_vec::<u8>(n)?, shape, device),
        DType::U32 => Tensor::from_vec(zeroed_vec::<u32>(n)?, shape, device),
        DType::I64 => Tensor::from_vec(zeroed_vec::<i64>(n)?, shape, device),
        _ => Tensor::zeros(shape, dtype, device),
    }
}

/// The `VmFlags` line of the mapping of `/proc/self/smaps` that holds `addr`.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn vm_flags(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split_whitespace().next().and_then(|r| {
            let (a, b) = r.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        // A mapping's header starts with its address range; field lines with a name.
        if let Some((a, b)) = range {
            inside = (a..b).contains(&addr);
        } else if inside && line.starts_with("VmFlags:") {
            return Some(line.to_string());
        }
    }
    None
}

/// Whether transparent huge pages can be asked for here and the advice shows in
/// `/proc/self/smaps` (tests skip their checks when not).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn thp_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
        && advice_is_reported()
}

/// Whether `MADV_HUGEPAGE` on a fresh anonymous mapping of our own shows as `hg` in its
/// flags. An emulator may accept the advice without passing it on: qemu-user does, so
/// under it (`scripts/test_aarch64.sh`) no buffer would ever show the mark.
#[cfg(all(test, target_os = "linux"))]
fn advice_is_reported() -> bool {
    const LEN: usize = 2 * HUGE_PAGE;
    with_fresh_mapping(LEN, |p| {
        // SAFETY: `p` is a fresh mapping of `LEN` bytes of our own.
        let advised = unsafe { libc::madvise(p as *mut libc::c_void, LEN, libc::MADV_HUGEPAGE) } == 0;
        advised && vm_flags(p).is_some_and(|f| f.split_whitespace().any(|x| x == "hg"))
    })
    .unwrap_or(false)
}

/// `f(address)` on a fresh private anonymous mapping of `len` bytes of our own, which is
/// unmapped when `f` returns; `None` when it cannot be mapped.
#[cfg(all(test, target_os = "linux"))]
fn with_fresh_mapping<R>(len: usize, f: impl FnOnce(usize) -> R) -> Option<R> {
    // SAFETY: a new mapping that only `f` uses, and only until it returns (it gets the
    // address, not a reference); unmapped here with the length it was mapped with.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return None;
        }
        let r = f(p as usize);
        libc::munmap(p, len);
        Some(r)
    }
}

/// Whether the mapping holding the first whole huge page of the `len` bytes at `addr`
/// is marked for huge pages (`hg`), or `None` when no whole huge page lies inside.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn marked_for_huge_pages(addr: usize, len: usize) -> Option<bool> {
    let (start, _) = huge_page_span(addr, len)?;
    let flags = vm_flags(start).expect("a live buffer's mapping is in /proc/self/smaps");
    Some(flags.split_whitespace().any(|f| f == "hg"))
}

/// The address and byte length of a CPU tensor's storage.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn storage_span(t: &Tensor) -> (usize, usize) {
    use candle::{CpuStorage, Storage};
    let (storage, _) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        panic!("not a CPU tensor")
    };
    let (addr, n) = match cpu {
        CpuStorage::F32(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F64(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F16(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::BF16(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::U8(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::U32(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::I64(v) => (v.as_ptr() as usize, v.len()),
        _ => panic!("no span for {:?}", t.dtype()),
    };
    (addr, n * t.dtype().size_in_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_span_is_the_whole_huge_pages_inside() {
        const M: usize = HUGE_PAGE;
        assert_eq!(huge_page_span(0, 3 * M), Some((0, 3 * M)));
        assert_eq!(huge_page_span(1, 3 * M), Some((M, 3 * M)));
        assert_eq!(huge_page_span(M - 16, M + 32), Some((M, 2 * M)));
        assert_eq!(huge_page_span(M - 16, M), None);
        assert_eq!(huge_page_span(5, M), None);
        assert_eq!(huge_page_span(usize::MAX - M, 2 * M), None);
    }

    /// Where the kernel has transparent huge pages, a large fresh buffer's pages are
    /// marked for them (`hg` in its mapping's flags) and a small one's are not.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_outputs_are_marked_for_huge_pages() {
        if !thp_available() {
            eprintln!("transparent huge pages off, absent or not reported: nothing to check");
            return;
        }
        let n = HUGE_OUTPUT_BYTES / 4;
        let mut big: Vec<f32> = Vec::with_capacity(n);
        advise_fresh_output(&mut big.spare_capacity_mut()[..n]);
        assert_eq!(marked_for_huge_pages(big.as_ptr() as usize, 4 * n), Some(true));
        let m = n / 4;
        let mut small: Vec<f32> = Vec::with_capacity(m);
        advise_fresh_output(&mut small.spare_capacity_mut()[..m]);
        assert_ne!(marked_for_huge_pages(small.as_ptr() as usize, 4 * m), Some(true));
    }

    /// `zeroed` gives zeros of the asked dtype and shape, and on Linux marks large
    /// buffers for huge pages and small ones not.
    #[test]
    fn zeroed_buffers_are_zeros_and_large_ones_are_marked() -> Result<()> {
        let dtypes = [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::U8,
            DType::U32,
            DType::I64,
        ];
        for dtype in dtypes {
            let elems = 2 * HUGE_CACHE_BYTES / dtype.size_in_bytes();
            let t = zeroed(&(2, elems / 2).into(), dtype, &Device::Cpu)?;
            assert_eq!((t.dims(), t.dtype()), (&[2, elems / 2][..], dtype));
            let sum = t.to_dtype(DType::F64)?.abs()?.sum_all()?.to_scalar::<f64>()?;
            assert_eq!(sum, 0.0, "{dtype:?}");
            #[cfg(target_os = "linux")]
            if thp_available() {
                let (addr, len) = storage_span(&t);
                assert_eq!(marked_for_huge_pages(addr, len), Some(true), "{dtype:?}");
                let small = zeroed(
                    &(HUGE_CACHE_BYTES / 8 / dtype.size_in_bytes(),).into(),
                    dtype,
                    &Device::Cpu,
                )?;
                let (addr, len) = storage_span(&small);
                assert_ne!(marked_for_huge_pages(addr, len), Some(true), "{dtype:?}");
            }
        }
        Ok(())
    }

    /// Small sizes of each element type (below the huge-page size, so no `madvise`;
    /// Miri runs it too: `cargo +nightly miri test --lib zeroed_vec`), and a size the
    /// allocator refuses.
    #[test]
    fn zeroed_vec_gives_zeros_or_an_error() -> Result<()> {
        fn check<T: ZeroBits + PartialEq + Default + std::fmt::Debug>() -> Result<()> {
            for n in [0, 1, 7, 1000] {
                let mut v = zeroed_vec::<T>(n)?;
                assert_eq!((v.len(), v.capacity()), (n, n));
                assert!(v.iter().all(|x| *x == T::default()));
                // The vector owns its memory as any other: it can grow and be freed.
                v.push(T::default());
                assert_eq!(v.len(), n + 1);
            }
            Ok(())
        }
        check::<f32>()?;
        check::<f64>()?;
        check::<u8>()?;
        check::<u16>()?;
        check::<u32>()?;
        check::<i64>()?;
        assert!(zeroed_vec::<f32>(usize::MAX / 2).is_err());
        Ok(())
    }

    /// Where this kernel populates on request, a large output prepared for the attention
    /// kernel has all its whole huge pages resident before anything is written, and a
    /// small one is left alone.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_attention_outputs_are_faulted_in_before_they_are_written() {
        if !populate_is_honoured() {
            eprintln!("MADV_POPULATE_WRITE refused or not honoured: nothing to check");
            return;
        }
        let n = HUGE_OUTPUT_BYTES / 4;
        let mut big: Vec<f32> = Vec::with_capacity(n);
        fault_in_fresh_output(&mut big.spare_capacity_mut()[..n]);
        let (start, end) = huge_page_span(big.as_ptr() as usize, 4 * n).expect("whole huge pages");
        assert_eq!(resident_pages(start, end - start), (end - start) / page_size());
        // A smaller one, in a fresh mapping of its own so that no earlier allocation
        // left pages resident: 12 MiB, so it holds whole huge pages.
        let len = HUGE_OUTPUT_BYTES / 4 + 4 * HUGE_PAGE;
        let resident = with_fresh_mapping(len, |p| {
            // SAFETY: `p` is a fresh mapping of `len` bytes of our own, so `len / 4`
            // (uninitialised) floats, used only here.
            let buf =
                unsafe { std::slice::from_raw_parts_mut(p as *mut std::mem::MaybeUninit<f32>, len / 4) };
            fault_in_fresh_output(buf);
            resident_pages(p, len)
        });
        assert_eq!(resident, Some(0));
    }

    /// The system's page size.
    #[cfg(target_os = "linux")]
    fn page_size() -> usize {
        // SAFETY: `sysconf` has no preconditions.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
    }

    /// How many pages of the `len` bytes at page-aligned `addr` are resident (`mincore`).
    #[cfg(target_os = "linux")]
    fn resident_pages(addr: usize, len: usize) -> usize {
        let mut vec = vec![0u8; len.div_ceil(page_size())];
        // SAFETY: `[addr, addr + len)` is mapped (callers pass live buffers) and `vec`
        // holds one byte per page.
        let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// Whether `MADV_POPULATE_WRITE` on a fresh mapping of our own leaves its pages
    /// resident: Linux before 5.14 refuses it, and an emulator may accept it without
    /// passing it on.
    #[cfg(target_os = "linux")]
    fn populate_is_honoured() -> bool {
        const LEN: usize = 2 * HUGE_PAGE;
        with_fresh_mapping(LEN, |p| {
            // SAFETY: `p` is a fresh mapping of `LEN` bytes of our own.
            let asked = unsafe { libc::madvise(p as *mut libc::c_void, LEN, MADV_POPULATE_WRITE) } == 0;
            asked && resident_pages(p, LEN) == LEN / page_size()
        })
        .unwrap_or(false)
    }

    #[test]
    fn advised_outputs_keep_what_is_written() {
        let n = HUGE_OUTPUT_BYTES / 4 + 1000;
        for fault_in in [false, true] {
            let mut v: Vec<u32> = Vec::with_capacity(n);
            if fault_in {
                fault_in_fresh_output(&mut v.spare_capacity_mut()[..n]);
            } else {
                advise_fresh_output(&mut v.spare_capacity_mut()[..n]);
            }
            v.extend((0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)));
            assert!(v
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i as u32).wrapping_mul(2_654_435_761)));
        }
    }
}
