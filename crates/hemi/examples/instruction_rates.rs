//! How many `vdpbf16ps` and F32 FMAs (zmm) one core issues per second: the figures behind
//! `cpu::gemm::select::Bf16Route`, which multiplies BF16 as pairs where `vdpbf16ps` does
//! twice the work of an FMA per instruction at about the FMA's rate (AMD Zen 4/5), and
//! widens BF16 to F32 where it issues far less often (Intel's AVX-512 BF16 cores).
//!
//! ```sh
//! cargo run --release -p hemi --example instruction_rates
//! ```
//!
//! Each loop runs 12 independent accumulator chains (more than latency × issue width on the
//! CPUs seen), so it measures issue rate, not latency. Prints the route this process takes.

use hemi::cpu::gemm::select::Bf16Route;
use std::time::Instant;

fn main() {
    println!("BF16 route on this CPU: {:?}", Bf16Route::current());
    #[cfg(target_arch = "x86_64")]
    {
        use hemi::cpu::features::Feature;
        let has = |f: Feature| f.detected();
        let iters = 20_000_000u64;
        if has(Feature::Avx512f) {
            // SAFETY: AVX-512 F checked above.
            let (rate, check) = best_of(3, || unsafe { x86::fma_rate(iters) });
            println!(
                "vfmadd231ps zmm: {rate:.2} G/s = {:.0} GFLOP/s (check {check})",
                rate * 32.0
            );
        } else {
            println!("no AVX-512 F");
        }
        if has(Feature::Avx512f) && has(Feature::Avx512bf16) {
            // SAFETY: AVX-512 F and BF16 checked above.
            let (rate, check) = best_of(3, || unsafe { x86::dpbf16_rate(iters) });
            println!(
                "vdpbf16ps zmm:   {rate:.2} G/s = {:.0} GFLOP/s (check {check})",
                rate * 64.0
            );
        } else {
            println!("no AVX-512 BF16");
        }
    }
}

/// The highest rate (G instructions/s) of `reps` runs, with the last run's checksum.
#[cfg(target_arch = "x86_64")]
fn best_of(reps: usize, mut run: impl FnMut() -> (u64, f32)) -> (f64, f32) {
    let mut best = 0.0f64;
    let mut check = 0.0;
    for _ in 0..reps {
        let t = Instant::now();
        let (instructions, sum) = run();
        best = best.max(instructions as f64 / t.elapsed().as_secs_f64() / 1e9);
        check = sum;
    }
    (best, check)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const CHAINS: usize = 12;

    /// `iters` × 12 FMAs; returns (instructions, a checksum).
    ///
    /// # Safety
    /// The CPU has AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_rate(iters: u64) -> (u64, f32) {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        let mut x = _mm512_set1_ps(0.999_9);
        let mut y = _mm512_set1_ps(1e-7);
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
            // Keep the operands opaque so the loop is not folded.
            std::arch::asm!("/* {0} {1} */", inout(zmm_reg) x, inout(zmm_reg) y,
                options(nomem, nostack, preserves_flags));
        }
        let sum = acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum();
        (iters * CHAINS as u64, sum)
    }

    /// `iters` × 12 `vdpbf16ps`; returns (instructions, a checksum).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16_rate(iters: u64) -> (u64, f32) {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        // 2^-10 and 2^-10 in every BF16 lane: each step adds 2 · 2^-20 per F32 lane.
        let mut x: __m512bh = std::mem::transmute(_mm512_set1_epi16(0x3a80));
        let mut y: __m512bh = std::mem::transmute(_mm512_set1_epi16(0x3a80));
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_dpbf16_ps(*a, x, y);
            }
            std::arch::asm!("/* {0} {1} */", inout(zmm_reg) x, inout(zmm_reg) y,
                options(nomem, nostack, preserves_flags));
        }
        let sum = acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum();
        (iters * CHAINS as u64, sum)
    }
}
