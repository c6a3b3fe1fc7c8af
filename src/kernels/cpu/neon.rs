//! AArch64 NEON micro-kernels: 6×16 register tiles (24 q-register accumulators,
//! 4 panel loads, 1 broadcast of the 32 available). Softmax uses the portable helpers.
//!
//! NEON is part of the AArch64 baseline, so no runtime detection beyond
//! `is_aarch64_feature_detected!("neon")` is needed.

use super::tiles::{assert_pv_operands, assert_qk_operands, BK, NR};
use std::arch::aarch64::*;

/// Rows per register tile.
pub(super) const MR: usize = super::tiles::MR;

/// See [`super::portable::qk`]; `rows` must be a multiple of [`MR`].
///
/// # Safety
/// NEON must be available.
pub(super) unsafe fn qk(
    q: &[f32],
    rows: usize,
    e: usize,
    kp: &[f32],
    npanels: usize,
    s: &mut [f32],
    lds: usize,
) {
    assert_qk_operands(q, (rows, e), kp, npanels, s, lds);
    // SAFETY: bounds asserted above; NEON guaranteed by the caller.
    unsafe { qk_impl(q.as_ptr(), rows, e, kp.as_ptr(), npanels, s.as_mut_ptr(), lds) }
}

#[target_feature(enable = "neon")]
unsafe fn qk_impl(
    q: *const f32,
    rows: usize,
    e: usize,
    kp: *const f32,
    npanels: usize,
    s: *mut f32,
    lds: usize,
) {
    for strip in 0..rows / MR {
        let qs = q.add(strip * MR * e);
        for p in 0..npanels {
            let kpp = kp.add(p * e * NR);
            let mut acc = [[vdupq_n_f32(0.0); 4]; MR];
            for x in 0..e {
                let k = [
                    vld1q_f32(kpp.add(x * NR)),
                    vld1q_f32(kpp.add(x * NR + 4)),
                    vld1q_f32(kpp.add(x * NR + 8)),
                    vld1q_f32(kpp.add(x * NR + 12)),
                ];
                for (r, accr) in acc.iter_mut().enumerate() {
                    let a = vdupq_n_f32(*qs.add(x * MR + r));
                    for (acc_c, &k_c) in accr.iter_mut().zip(k.iter()) {
                        *acc_c = vfmaq_f32(*acc_c, a, k_c);
                    }
                }
            }
            let sp = s.add(strip * MR * lds + p * NR);
            for (r, accr) in acc.iter().enumerate() {
                for (c, &acc_c) in accr.iter().enumerate() {
                    vst1q_f32(sp.add(r * lds + 4 * c), acc_c);
                }
            }
        }
    }
}

/// See [`super::portable::pv`]; `rows` must be a multiple of [`MR`].
///
/// # Safety
/// NEON must be available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv(
    p: &[f32],
    rows: usize,
    nk: usize,
    vp: &[f32],
    vps: usize,
    ldv: usize,
    nvp: usize,
    o: &mut [f32],
    ldo: usize,
    alpha: &[f32],
) {
    assert_pv_operands(p, (rows, BK), &[(vp, nk)], (vps, ldv, nvp), o, ldo, alpha);
    // SAFETY: bounds asserted above; NEON guaranteed by the caller.
    unsafe {
        pv_impl(
            p.as_ptr(),
            rows,
            nk,
            vp.as_ptr(),
            vps,
            ldv,
            nvp,
            o.as_mut_ptr(),
            ldo,
            alpha.as_ptr(),
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
unsafe fn pv_impl(
    p: *const f32,
    rows: usize,
    nk: usize,
    vp: *const f32,
    vps: usize,
    ldv: usize,
    nvp: usize,
    o: *mut f32,
    ldo: usize,
    alpha: *const f32,
) {
    for strip in 0..rows / MR {
        let ps = p.add(strip * MR * BK);
        let os = o.add(strip * MR * ldo);
        for n in 0..nvp {
            let vpp = vp.add(n * vps);
            let op = os.add(n * NR);
            let mut acc = [[vdupq_n_f32(0.0); 4]; MR];
            for (r, accr) in acc.iter_mut().enumerate() {
                let a = vdupq_n_f32(*alpha.add(strip * MR + r));
                for (c, acc_c) in accr.iter_mut().enumerate() {
                    *acc_c = vmulq_f32(a, vld1q_f32(op.add(r * ldo + 4 * c)));
                }
            }
            for j in 0..nk {
                let v = [
                    vld1q_f32(vpp.add(j * ldv)),
                    vld1q_f32(vpp.add(j * ldv + 4)),
                    vld1q_f32(vpp.add(j * ldv + 8)),
                    vld1q_f32(vpp.add(j * ldv + 12)),
                ];
                for (r, accr) in acc.iter_mut().enumerate() {
                    let a = vdupq_n_f32(*ps.add(r * BK + j));
                    for (acc_c, &v_c) in accr.iter_mut().zip(v.iter()) {
                        *acc_c = vfmaq_f32(*acc_c, a, v_c);
                    }
                }
            }
            for (r, accr) in acc.iter().enumerate() {
                for (c, &acc_c) in accr.iter().enumerate() {
                    vst1q_f32(op.add(r * ldo + 4 * c), acc_c);
                }
            }
        }
    }
}
