//! The fused CPU kernel (detected instruction set) agrees with the reference path.
#[path = "shared/kernel_cases.rs"]
mod kernel_cases;

#[test]
fn fused_kernel_matches_reference_on_randomised_shapes() -> candle_core::Result<()> {
    if std::env::var("CANDLE_ATTENTION_ISA").is_ok() {
        eprintln!(
            "note: CANDLE_ATTENTION_ISA is set; this run covers {}",
            candle_attention::cpu_kernel_isa()
        );
    }
    let n = kernel_cases::fused_matches_reference(1)?;
    assert!(n > 1000, "only {n} comparisons");
    let n = kernel_cases::sinks_split_k_matches_reference(1)?;
    assert_eq!(n, 24);
    Ok(())
}

#[test]
fn detected_isa_is_reported() {
    let isa = candle_attention::cpu_kernel_isa();
    assert!(["avx512", "avx2+fma", "neon", "portable"].contains(&isa), "{isa}");
}
