//! The AVX-512 decode kernels, and the AVX2 decode strips that walk each f32 K row to
//! its end, with their software prefetch of K/V rows switched the other way from this
//! machine's default (`CANDLE_ATTENTION_DECODE_PREFETCH`: on by default on Intel CPUs
//! only), so that both settings stay covered wherever AVX-512 or AVX2 runs: the default
//! in `tests/kernel.rs` and `tests/kernel_avx2.rs`, the other one here. (A separate test
//! binary, so the variables affect nothing else; one test, so that the variable is set
//! before the kernel reads it.) Elsewhere this runs the same comparison as
//! `tests/kernel.rs`.
#[path = "shared/kernel_cases.rs"]
mod kernel_cases;

#[test]
fn decode_prefetch_the_other_way_matches_reference() -> candle_core::Result<()> {
    use candle_attention::kernels::cpu::decode_prefetch_by_default;
    let other = if decode_prefetch_by_default() { "0" } else { "1" };
    std::env::set_var("CANDLE_ATTENTION_DECODE_PREFETCH", other);
    let n = kernel_cases::fused_matches_reference(5)?;
    assert!(n > 1000, "only {n} comparisons");
    let n = kernel_cases::sinks_split_k_matches_reference(5)?;
    assert_eq!(n, 24);
    // The AVX2 kernels too, where the machine would pick AVX-512 (the instruction set is
    // read per call).
    use candle_attention::kernels::cpu::Isa;
    if Isa::Avx2Fma.is_supported() && candle_attention::cpu_kernel_isa() != "avx2+fma" {
        std::env::set_var("CANDLE_ATTENTION_ISA", "avx2");
        assert_eq!(candle_attention::cpu_kernel_isa(), "avx2+fma");
        let n = kernel_cases::fused_matches_reference(7)?;
        assert!(n > 1000, "only {n} comparisons");
    }
    Ok(())
}
