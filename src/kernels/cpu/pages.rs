//! Fresh output buffers: asks Linux for transparent huge pages on outputs large enough
//! to come straight from `mmap`, so that writing them faults in 2 MiB pages instead of
//! 4 KiB ones.
//!
//! glibc serves every allocation of [`HUGE_OUTPUT_BYTES`] (32 MiB, its largest dynamic
//! mmap threshold) or more with a fresh mapping and unmaps it on free, so each call
//! that returns such an output faults in all of it again. On the 2-core Zen 4 VM
//! (transparent huge pages in `madvise` mode) the 32 MiB f32 output of
//! `gpt2k_causal_d128` spent 17–20 ms of thread time in those faults, about 5% of the
//! call's thread time (with the advice the call ran 2.6% faster). Smaller outputs are
//! reused from the heap and did not fault (`long8k_causal`'s 16 MiB: under 2 ms of thread
//! time, all of the stores included).
//!
//! The advice is a hint: where the kernel refuses it (huge pages off, not Linux) the
//! buffer is used as it is.

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
    if len < HUGE_OUTPUT_BYTES {
        return;
    }
    #[cfg(target_os = "linux")]
    if let Some((start, end)) = huge_page_span(buf.as_mut_ptr() as usize, len) {
        // SAFETY: `[start, end)` lies inside `buf`, which this thread holds mutably and
        // has not initialised; `MADV_HUGEPAGE` changes how its pages are faulted in,
        // never their contents. The result is ignored: the advice is only a hint.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
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

    /// The `VmFlags` line of the mapping of `/proc/self/smaps` that holds `addr`.
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> Option<String> {
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

    /// Where the kernel has transparent huge pages, a large fresh buffer's pages are
    /// marked for them (`hg` in its mapping's flags) and a small one's are not.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_outputs_are_marked_for_huge_pages() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        if !thp.is_ok_and(|s| !s.contains("[never]")) {
            eprintln!("transparent huge pages off or absent: nothing to check");
            return;
        }
        let n = HUGE_OUTPUT_BYTES / 4;
        let mut big: Vec<f32> = Vec::with_capacity(n);
        advise_fresh_output(&mut big.spare_capacity_mut()[..n]);
        let (start, _) =
            huge_page_span(big.as_ptr() as usize, 4 * n).expect("a 32 MiB buffer holds huge pages");
        let flags = vm_flags(start).expect("the buffer's mapping is in /proc/self/smaps");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        let m = n / 4;
        let mut small: Vec<f32> = Vec::with_capacity(m);
        advise_fresh_output(&mut small.spare_capacity_mut()[..m]);
        if let Some((start, _)) = huge_page_span(small.as_ptr() as usize, 4 * m) {
            let flags = vm_flags(start).expect("the buffer's mapping is in /proc/self/smaps");
            assert!(!flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        }
    }

    #[test]
    fn advised_outputs_keep_what_is_written() {
        let n = HUGE_OUTPUT_BYTES / 4 + 1000;
        let mut v: Vec<u32> = Vec::with_capacity(n);
        advise_fresh_output(&mut v.spare_capacity_mut()[..n]);
        v.extend((0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)));
        assert!(v
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i as u32).wrapping_mul(2_654_435_761)));
    }
}
