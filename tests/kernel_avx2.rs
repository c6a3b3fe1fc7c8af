//! The AVX2+FMA kernel and its projection product, forced with
//! `CANDLE_ATTENTION_ISA=avx2`, agree with the reference path, so they stay covered on
//! machines that would pick AVX-512. (A separate test binary, so the variable affects
//! nothing else; one test, so that the variable is set before anything reads it.)
#[path = "shared/kernel_cases.rs"]
mod kernel_cases;
#[path = "shared/proj_cases.rs"]
mod proj_cases;

#[test]
fn avx2_kernel_matches_reference_on_randomised_shapes() -> candle_core::Result<()> {
    use candle_attention::kernels::cpu::Isa;
    std::env::set_var("CANDLE_ATTENTION_ISA", "avx2");
    if !Isa::Avx2Fma.is_supported() {
        // The override falls back to detection; say so instead of passing silently.
        eprintln!(
            "note: no AVX2+FMA here; the forced run covers {}",
            candle_attention::cpu_kernel_isa()
        );
        assert_ne!(candle_attention::cpu_kernel_isa(), "avx2+fma");
        return Ok(());
    }
    assert_eq!(candle_attention::cpu_kernel_isa(), "avx2+fma");
    let n = kernel_cases::fused_matches_reference(3)?;
    assert!(n > 1000, "only {n} comparisons");
    let n = kernel_cases::sinks_split_k_matches_reference(3)?;
    assert_eq!(n, 24);
    proj_cases::all_cases_pass()
}
