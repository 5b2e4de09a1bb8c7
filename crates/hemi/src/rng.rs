//! Seeded random numbers. Every random tensor, dropout mask and shuffle in hemi draws from
//! a `Generator` the caller owns, so a run is reproducible from its seed and its generator
//! state can be saved and restored (checkpoints).

use rand::{Rng as _, RngCore, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use rand_xoshiro::Xoshiro256PlusPlus;

/// The dropout decision of element `idx` under `seed`, counter-based so that any element
/// can be decided alone (in parallel, or again in a backward): a splitmix64 hash of the seed
/// and the index, its top 53 bits compared with `threshold = p · 2^53` (kept when not
/// below it, so with probability 1 - p).
#[inline(always)]
#[doc(hidden)]
pub fn keep53(seed: u64, idx: u64, threshold: u64) -> bool {
    let mut z = seed.wrapping_add(idx.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) >= threshold
}

/// The dropout factors of elements `base..base + out.len()`: `keep` where `keep53` keeps the
/// element, `drop` (zero) where it drops it. The same bits as calling `keep53` one element at
/// a time; on x86-64 with AVX-512 DQ the hash runs eight lanes at a time (`vpmullq`: dropout
/// went from 6–10 % of a BERT amp-bf16 step to 0.6 % on Zen 5), and on AVX2 four lanes with
/// the 64-bit products emulated (`vpmuludq`; not timed, no AVX2-only CPU at hand).
#[doc(hidden)]
pub fn keep_factors<C: Copy>(
    seed: u64,
    base: u64,
    threshold: u64,
    keep: C,
    drop: C,
    out: &mut [C],
) {
    #[cfg(target_arch = "x86_64")]
    {
        /// # Safety
        /// The CPU has AVX-512 F, DQ, VL and BW.
        #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw")]
        unsafe fn avx512<C: Copy>(s: u64, b: u64, t: u64, k: C, d: C, out: &mut [C]) {
            keep_factors_loop(s, b, t, k, d, out)
        }
        /// # Safety
        /// The CPU has AVX2.
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<C: Copy>(s: u64, b: u64, t: u64, k: C, d: C, out: &mut [C]) {
            keep_factors_loop(s, b, t, k, d, out)
        }
        if cpu_has!(Avx512f) && cpu_has!(Avx512dq) && cpu_has!(Avx512vl) && cpu_has!(Avx512bw) {
            // SAFETY: the features were detected.
            return unsafe { avx512(seed, base, threshold, keep, drop, out) };
        }
        if cpu_has!(Avx2) {
            // SAFETY: the feature was detected.
            return unsafe { avx2(seed, base, threshold, keep, drop, out) };
        }
    }
    keep_factors_loop(seed, base, threshold, keep, drop, out)
}

#[inline(always)]
fn keep_factors_loop<C: Copy>(
    seed: u64,
    base: u64,
    threshold: u64,
    keep: C,
    drop: C,
    out: &mut [C],
) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = if keep53(seed, base.wrapping_add(j as u64), threshold) {
            keep
        } else {
            drop
        };
    }
}

/// `p · 2^53`, the threshold `keep53` compares with.
#[doc(hidden)]
pub fn threshold53(p: f64) -> u64 {
    (p * (1u64 << 53) as f64) as u64
}

/// A seeded pseudo-random generator (xoshiro256++).
#[derive(Clone, Debug)]
pub struct Generator {
    inner: Xoshiro256PlusPlus,
}

impl Generator {
    /// A generator seeded with `seed`; the same seed gives the same stream on every
    /// machine.
    pub fn new(seed: u64) -> Self {
        Generator {
            inner: Xoshiro256PlusPlus::seed_from_u64(seed),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn uniform_f64(&mut self) -> f64 {
        self.inner.random::<f64>()
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform_f64()
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        StandardNormal.sample(&mut self.inner)
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        self.inner.random_range(0..n)
    }

    /// A new generator seeded from this one (for per-worker or per-epoch streams).
    pub fn fork(&mut self) -> Generator {
        Generator::new(self.next_u64())
    }
}
