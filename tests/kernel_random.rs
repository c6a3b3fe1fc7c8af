//! The fused CPU kernel against the reference path on randomly drawn shapes: batch,
//! heads, GQA ratio, L, S, E and Ev, each shape with every mask of
//! `shared/kernel_cases.rs` in f32, f16 and bf16, strided inputs.
//!
//! Slow, so `#[ignore]`d (CI does not run it). Run it after a kernel change with
//! `cargo test --release --test kernel_random -- --ignored --nocapture`;
//! `KERNEL_RANDOM_SEEDS` (default 50) and `KERNEL_RANDOM_BASE` (default 1000) choose the
//! draws, one shape per seed, so a failure reproduces from the seed it prints.
#[allow(dead_code)] // the fixed-shape comparisons of the module serve the other tests
#[path = "shared/kernel_cases.rs"]
mod kernel_cases;

use candle_attention::{sdpa, Backend, SdpaOptions};
use candle_core::{DType, Result, Tensor};
use kernel_cases::{masks, rel_err, tol, Lcg, Shape};

/// Head sizes drawn for E and Ev: the register-tile widths (8, 16, 64, 128, 256) and
/// sizes between them, including ones that are not a multiple of 16.
const DIMS: [usize; 10] = [8, 16, 24, 40, 64, 72, 96, 128, 136, 256];

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn draw(r: &mut Lcg) -> Shape {
    let hkv = 1 + r.below(3);
    let group = [1, 2, 3, 4, 8][r.below(5)];
    // A third of the shapes decode-sized (L ≤ 30), a quarter with S up to 2500 (split
    // key ranges and several key blocks).
    let l = if r.below(3) == 0 {
        1 + r.below(30)
    } else {
        1 + r.below(400)
    };
    let s_max = if r.below(4) == 0 { 2500 } else { 400 };
    let s = 1 + r.below(s_max);
    Shape {
        b: 1 + r.below(3),
        hq: hkv * group,
        hkv,
        l,
        s,
        e: DIMS[r.below(DIMS.len())],
        ev: DIMS[r.below(DIMS.len())],
    }
}

/// Where fused and reference differ by more than the dtype's tolerance, both f32 paths
/// may be rounding apart on sharp logits (E = 256 with a scale near 1 gives logits with
/// a standard deviation near 16): then the fused result must be within the tolerance of
/// the float64 reference path, or no further from it than twice the reference path's
/// own error.
fn arbitrate(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &SdpaOptions,
    got: &Tensor,
    want: &Tensor,
) -> Result<(f64, f64)> {
    let f64s = |t: &Tensor| t.to_dtype(DType::F64);
    let truth = sdpa(
        &f64s(q)?,
        &f64s(k)?,
        &f64s(v)?,
        &opts.clone().with_backend(Backend::Reference),
    )?;
    Ok((rel_err(got, &truth)?, rel_err(want, &truth)?))
}

#[test]
#[ignore = "slow: run with --release -- --ignored"]
fn fused_matches_reference_on_random_shapes() -> Result<()> {
    let (seeds, base) = (
        env_or("KERNEL_RANDOM_SEEDS", 50),
        env_or("KERNEL_RANDOM_BASE", 1000),
    );
    let mut checked = 0;
    for seed in base..base + seeds {
        let mut r = Lcg::new(seed);
        let sh = draw(&mut r);
        // (B, L, H, E) viewed as (B, H, L, E): strided inputs.
        let q = r.normal(&[sh.b, sh.l, sh.hq, sh.e])?.transpose(1, 2)?;
        let k = r.normal(&[sh.b, sh.s, sh.hkv, sh.e])?.transpose(1, 2)?;
        let v = r.normal(&[sh.b, sh.s, sh.hkv, sh.ev])?.transpose(1, 2)?;
        for (name, opts) in masks(&mut r, &sh)? {
            let opts = opts.with_gqa(sh.hq != sh.hkv);
            for dt in [DType::F32, DType::F16, DType::BF16] {
                let (qd, kd, vd) = (q.to_dtype(dt)?, k.to_dtype(dt)?, v.to_dtype(dt)?);
                let want = sdpa(&qd, &kd, &vd, &opts.clone().with_backend(Backend::Reference))?;
                let got = sdpa(&qd, &kd, &vd, &opts.clone().with_backend(Backend::Fused))?;
                assert_eq!(got.dtype(), dt, "seed {seed} {sh:?} {name}");
                let err = rel_err(&got, &want)?;
                if err > tol(dt) {
                    let (fused, reference) = arbitrate(&qd, &kd, &vd, &opts, &got, &want)?;
                    eprintln!(
                        "seed {seed} {sh:?} {name} {dt:?}: fused against reference {err:e}; \
                         against float64, fused {fused:e} and reference {reference:e}"
                    );
                    assert!(
                        fused <= tol(dt) || fused <= 2.0 * reference,
                        "seed {seed} {sh:?} {name} {dt:?}: the fused kernel is off"
                    );
                }
                checked += 1;
            }
        }
    }
    eprintln!("{checked} comparisons over {seeds} shapes");
    assert!(checked as u64 >= 3 * seeds, "only {checked} comparisons");
    Ok(())
}
