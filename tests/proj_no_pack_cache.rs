//! `Proj` with no room for kept packs (`CANDLE_ATTENTION_PACK_CACHE_MB=0`, as when a
//! large model's layers have filled the pack cache) agrees with candle's `matmul`
//! reference on the cases of `shared/proj_cases.rs`: products of a register tile of rows
//! or more pack the weight for each call, and fewer rows read it in place (bf16 rows
//! against a bf16 weight, which the AMX and AVX512-BF16 products take without an f32
//! copy, are read as f32 there). (A separate test binary, so the variable affects
//! nothing else; one test, so that it is set before the budget is first read.)
#[path = "shared/proj_cases.rs"]
mod proj_cases;

#[test]
fn projections_without_kept_packs_match_the_reference() -> candle_core::Result<()> {
    std::env::set_var("CANDLE_ATTENTION_PACK_CACHE_MB", "0");
    proj_cases::all_cases_pass()
}
