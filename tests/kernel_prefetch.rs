//! The AVX-512 decode kernels with their software prefetch of K/V rows switched
//! the other way from this machine's default (`CANDLE_ATTENTION_DECODE_PREFETCH`: on by
//! default on Intel CPUs only), so that both settings stay covered wherever AVX-512
//! runs: the default in `tests/kernel.rs`, the other one here. (A separate test binary,
//! so the variable affects nothing else; one test, so that the variable is set before
//! the kernel reads it.) Elsewhere this runs the same comparison as `tests/kernel.rs`.
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
    Ok(())
}
