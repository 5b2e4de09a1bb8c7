//! The unit tests of `hemi::cpu::conv::amx` (`src/cpu/conv/amx.rs`), run against the built library.

use half::bf16;
use hemi::cpu::conv::amx::*;

/// The AVX-512 pair runs equal the plain loop at strides 1 and 2, every tail length,
/// from odd starts, without reading past their runs (the slices end where they end).
#[test]
fn pair_runs_equal_the_portable_loop() {
    let vals: Vec<bf16> = (0..200u16)
        .map(|i| bf16::from_bits(i.wrapping_mul(40503)))
        .collect();
    let his: Vec<bf16> = (0..200u16).map(|i| bf16::from_bits(i ^ 0xA5C3)).collect();
    for sw in [1, 2, 3] {
        for len in 1..40 {
            for start in [0, 1, 7] {
                let n = (len - 1) * sw + 1;
                let (lo, hi) = (&vals[start..start + n], &his[start + 3..start + 3 + n]);
                let mut want = vec![0u32; len];
                pair_run_portable(&mut want, lo, hi, sw);
                let mut got = vec![u32::MAX; len + 1];
                pair_run_portable(&mut got[..len], lo, hi, sw);
                #[cfg(target_arch = "x86_64")]
                if sw <= 2 && wide_store() {
                    // SAFETY: AVX-512 F/BW/VL; the lengths as `pair_run` needs.
                    unsafe { x86::pair_run(&mut got[..len], lo, hi, sw) };
                }
                assert_eq!(&got[..len], &want[..], "sw {sw} len {len} start {start}");
                assert_eq!(got[len], u32::MAX, "wrote past the run");
                assert_eq!(
                    want[0],
                    u32::from(lo[0].to_bits()) | u32::from(hi[0].to_bits()) << 16
                );
            }
        }
    }
}
