//! The portable fallback kernel, forced with `CANDLE_ATTENTION_ISA=portable`, agrees with
//! the reference path. (A separate test binary, so the variable affects nothing else.)
#[path = "shared/kernel_cases.rs"]
mod kernel_cases;

#[test]
fn portable_kernel_matches_reference_on_randomised_shapes() -> candle_core::Result<()> {
    std::env::set_var("CANDLE_ATTENTION_ISA", "portable");
    assert_eq!(candle_attention::cpu_kernel_isa(), "portable");
    let n = kernel_cases::fused_matches_reference(2)?;
    assert!(n > 1000, "only {n} comparisons");
    let n = kernel_cases::sinks_split_k_matches_reference(2)?;
    assert_eq!(n, 24);
    Ok(())
}
