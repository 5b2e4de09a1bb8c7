//! The unit tests of `hemi::dtype::convert` (`src/dtype/convert.rs`), run against the built library.

use half::{bf16, f16};
use hemi::dtype::convert::*;
use rayon::prelude::*;

/// splitmix64: a tiny deterministic generator, enough to spread test inputs.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    /// F32 bit patterns: mostly uniform bits (NaNs, infinities and subnormals come up
    /// naturally, about 1 in 256 and 1 in 512), plus a share from the classes that
    /// uniform bits rarely hit: subnormals, ties, near overflow.
    fn f32_bits(&mut self) -> u32 {
        let r = self.next_u32();
        let sign = self.next_u32() & 0x8000_0000;
        match self.next_u32() % 8 {
            0 => sign | (r & 0x007F_FFFF),               // subnormal or zero
            1 => (r & 0xFFFF_0000) | 0x8000,             // BF16 tie
            2 => (r & 0xFFFF_E000) | 0x1000,             // F16 tie (normal F16 range)
            3 => sign | 0x7F7F_0000 | (r & 0xFFFF),      // near BF16 overflow
            4 => sign | 0x7F80_0000 | (r & 0x007F_FFFF), // inf or NaN
            _ => r,
        }
    }
}

fn random_f32(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| f32::from_bits(rng.f32_bits())).collect()
}

const LENGTHS: [usize; 14] = [0, 1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 1023, 4097];

fn bf16_of(x: f32) -> u16 {
    let mut d = [bf16::ZERO];
    f32_to_bf16(&[x], &mut d);
    d[0].to_bits()
}

fn f16_of(x: f32) -> u16 {
    let mut d = [f16::ZERO];
    f32_to_f16(&[x], &mut d);
    d[0].to_bits()
}

/// The `*_vec` conversions (into fresh, never zero-filled vectors) give the bits of the
/// slice conversions, at small lengths, kilo-element edges and past the parallel split.
#[test]
fn conversions_into_new_vectors_equal_the_slice_conversions() {
    let mut rng = Rng(77);
    let lengths = LENGTHS.iter().copied().chain([1025, PAR_MIN_LEN + 1037]);
    for n in lengths {
        let x = random_f32(&mut rng, n);
        let mut h = vec![f16::ZERO; n];
        f32_to_f16(&x, &mut h);
        let mut b = vec![bf16::ZERO; n];
        f32_to_bf16(&x, &mut b);
        let bits = |v: &[u16]| v.to_vec();
        let hb: Vec<u16> = h.iter().map(|v| v.to_bits()).collect();
        let bb: Vec<u16> = b.iter().map(|v| v.to_bits()).collect();
        let hv: Vec<u16> = f32_to_f16_vec(&x).iter().map(|v| v.to_bits()).collect();
        let bv: Vec<u16> = f32_to_bf16_vec(&x).iter().map(|v| v.to_bits()).collect();
        assert_eq!(bits(&hv), hb, "f32 -> f16, n = {n}");
        assert_eq!(bits(&bv), bb, "f32 -> bf16, n = {n}");
        let (mut hw, mut bw) = (vec![0f32; n], vec![0f32; n]);
        f16_to_f32(&h, &mut hw);
        bf16_to_f32(&b, &mut bw);
        let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            f32_bits(&f16_to_f32_vec(&h)),
            f32_bits(&hw),
            "f16 -> f32, n = {n}"
        );
        assert_eq!(
            f32_bits(&bf16_to_f32_vec(&b)),
            f32_bits(&bw),
            "bf16 -> f32, n = {n}"
        );
    }
}

#[test]
fn every_f16_round_trips_through_f32() {
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut wide = vec![0f32; all.len()];
    f16_to_f32(&all, &mut wide);
    let mut back = vec![f16::ZERO; all.len()];
    f32_to_f16(&wide, &mut back);
    for ((h, w), b) in all.iter().zip(&wide).zip(&back) {
        assert_eq!(
            w.to_bits(),
            h.to_f32().to_bits(),
            "f16 {:#06x} widens",
            h.to_bits()
        );
        if h.is_nan() {
            assert!(w.is_nan() && b.is_nan(), "f16 NaN {:#06x}", h.to_bits());
        } else {
            assert_eq!(
                b.to_bits(),
                h.to_bits(),
                "f16 {:#06x} round trip",
                h.to_bits()
            );
        }
    }
}

#[test]
fn every_bf16_round_trips_through_f32() {
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut wide = vec![0f32; all.len()];
    bf16_to_f32(&all, &mut wide);
    let mut back = vec![bf16::ZERO; all.len()];
    f32_to_bf16(&wide, &mut back);
    for ((h, w), b) in all.iter().zip(&wide).zip(&back) {
        // Bit-identical to half's scalar conversion, NaNs included (quiet bit set).
        assert_eq!(
            w.to_bits(),
            h.to_f32().to_bits(),
            "bf16 {:#06x} widens",
            h.to_bits()
        );
        if h.is_nan() {
            assert!(w.is_nan() && b.is_nan(), "bf16 NaN {:#06x}", h.to_bits());
            assert_eq!(
                b.to_bits(),
                h.to_bits() | 0x0040,
                "NaN keeps sign and payload"
            );
        } else {
            assert_eq!(
                w.to_bits(),
                (h.to_bits() as u32) << 16,
                "widening is a shift"
            );
            assert_eq!(
                b.to_bits(),
                h.to_bits(),
                "bf16 {:#06x} round trip",
                h.to_bits()
            );
        }
    }
}

#[test]
fn f16_rounds_ties_to_even() {
    let ulp = 2f32.powi(-10); // F16 ulp at 1.0
                              // 1 + ulp/2 lies between 0x3C00 (even) and 0x3C01: goes down.
    assert_eq!(f16_of(1.0 + ulp / 2.0), 0x3C00);
    // 1 + 3ulp/2 lies between 0x3C01 and 0x3C02 (even): goes up.
    assert_eq!(f16_of(1.0 + 3.0 * ulp / 2.0), 0x3C02);
    // One F32 ulp off the tie decides it.
    let above = f32::from_bits((1.0f32 + ulp / 2.0).to_bits() + 1);
    let below = f32::from_bits((1.0f32 + 3.0 * ulp / 2.0).to_bits() - 1);
    assert_eq!(f16_of(above), 0x3C01);
    assert_eq!(f16_of(below), 0x3C01);
    assert_eq!(f16_of(-(1.0 + ulp / 2.0)), 0xBC00);
    assert_eq!(f16_of(-(1.0 + 3.0 * ulp / 2.0)), 0xBC02);
}

#[test]
fn f16_overflow_boundary() {
    assert_eq!(f16_of(65504.0), 0x7BFF);
    assert_eq!(f16_of(65519.99), 0x7BFF);
    assert_eq!(f16_of(f32::from_bits(65520f32.to_bits() - 1)), 0x7BFF);
    assert_eq!(f16_of(65520.0), 0x7C00); // the tie goes to the even neighbour: inf
    assert_eq!(f16_of(-65504.0), 0xFBFF);
    assert_eq!(f16_of(-65520.0), 0xFC00);
    assert_eq!(f16_of(1e10), 0x7C00);
    assert_eq!(f16_of(f32::MAX), 0x7C00);
}

#[test]
fn f16_subnormals() {
    let tiny = 2f32.powi(-24); // smallest F16 subnormal
    assert_eq!(f16_of(tiny), 0x0001);
    assert_eq!(f16_of(tiny / 2.0), 0x0000); // tie between 0 and 0x0001: to even, 0
    assert_eq!(f16_of(-tiny / 2.0), 0x8000);
    assert_eq!(f16_of(f32::from_bits((tiny / 2.0).to_bits() + 1)), 0x0001);
    assert_eq!(f16_of(tiny * 1.5), 0x0002); // tie between 1 and 2: to even, 2
    assert_eq!(f16_of(tiny * 2.5), 0x0002); // tie between 2 and 3: to even, 2
    assert_eq!(f16_of(tiny * 1023.0), 0x03FF); // largest subnormal
    assert_eq!(f16_of(2f32.powi(-14)), 0x0400); // smallest normal
    assert_eq!(f16_of(tiny * 1023.5), 0x0400); // tie rounds up into the normals
    assert_eq!(f16_of(tiny / 4.0), 0x0000);
    for k in 0..1024u16 {
        assert_eq!(f16_of(tiny * k as f32), k, "subnormal {k}");
    }
}

#[test]
fn bf16_rounds_ties_to_even() {
    // 1.0 = 0x3F80_0000; a BF16 ulp at 1.0 is 0x1_0000 in F32 bits.
    assert_eq!(bf16_of(f32::from_bits(0x3F80_8000)), 0x3F80); // tie, down to even
    assert_eq!(bf16_of(f32::from_bits(0x3F81_8000)), 0x3F82); // tie, up to even
    assert_eq!(bf16_of(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(bf16_of(f32::from_bits(0x3F81_7FFF)), 0x3F81);
    assert_eq!(bf16_of(f32::from_bits(0xBF80_8000)), 0xBF80);
    assert_eq!(bf16_of(f32::from_bits(0xBF81_8000)), 0xBF82);
    // A carry out of the mantissa bumps the exponent: 0x3FFF_8000 -> 2.0.
    assert_eq!(bf16_of(f32::from_bits(0x3FFF_8000)), 0x4000);
}

#[test]
fn bf16_overflow_boundary() {
    // BF16 max is 0x7F7F = (2 - 2^-7) * 2^127; the tie towards inf is 0x7F7F_8000, and
    // 0x7F7F is odd, so the tie goes to inf.
    assert_eq!(bf16_of(f32::from_bits(0x7F7F_0000)), 0x7F7F);
    assert_eq!(bf16_of(f32::from_bits(0x7F7F_7FFF)), 0x7F7F);
    assert_eq!(bf16_of(f32::from_bits(0x7F7F_8000)), 0x7F80);
    assert_eq!(bf16_of(f32::MAX), 0x7F80);
    assert_eq!(bf16_of(f32::from_bits(0xFF7F_7FFF)), 0xFF7F);
    assert_eq!(bf16_of(f32::MIN), 0xFF80);
}

#[test]
fn bf16_subnormals() {
    // F32 subnormal bits 0x0001_0000 is the smallest BF16 subnormal, 2^-133.
    assert_eq!(bf16_of(f32::from_bits(0x0001_0000)), 0x0001);
    assert_eq!(bf16_of(f32::from_bits(0x0000_8000)), 0x0000); // half of it: tie, to 0
    assert_eq!(bf16_of(f32::from_bits(0x8000_8000)), 0x8000);
    assert_eq!(bf16_of(f32::from_bits(0x0000_8001)), 0x0001); // a bit more: up
    assert_eq!(bf16_of(f32::from_bits(0x0001_8000)), 0x0002); // tie, up to even
    assert_eq!(bf16_of(f32::from_bits(0x0002_8000)), 0x0002); // tie, down to even
    assert_eq!(bf16_of(f32::from_bits(0x0000_0001)), 0x0000); // F32's smallest
    assert_eq!(bf16_of(f32::from_bits(0x007F_0000)), 0x007F); // largest subnormal
    assert_eq!(bf16_of(f32::from_bits(0x007F_FFFF)), 0x0080); // rounds up to normal
    assert_eq!(bf16_of(f32::MIN_POSITIVE), 0x0080);
}

#[test]
fn zeros_infinities_and_nans() {
    assert_eq!(bf16_of(0.0), 0x0000);
    assert_eq!(bf16_of(-0.0), 0x8000);
    assert_eq!(f16_of(0.0), 0x0000);
    assert_eq!(f16_of(-0.0), 0x8000);
    assert_eq!(bf16_of(f32::INFINITY), 0x7F80);
    assert_eq!(bf16_of(f32::NEG_INFINITY), 0xFF80);
    assert_eq!(f16_of(f32::INFINITY), 0x7C00);
    assert_eq!(f16_of(f32::NEG_INFINITY), 0xFC00);
    // Signalling NaNs whose payload lives only in the dropped bits must not become inf.
    for bits in [
        0x7F80_0001u32,
        0xFF80_0001,
        0x7FA0_0000,
        0x7FC0_0000,
        0xFFFF_FFFF,
    ] {
        let sign = bits & 0x8000_0000 != 0;
        let b = bf16::from_bits(bf16_of(f32::from_bits(bits)));
        assert!(
            b.is_nan() && b.to_bits() & 0x0040 != 0,
            "{bits:#x} -> quiet bf16 NaN"
        );
        assert_eq!(b.is_sign_negative(), sign);
        assert_eq!(b.to_bits(), bf16::from_f32(f32::from_bits(bits)).to_bits());
        let h = f16::from_bits(f16_of(f32::from_bits(bits)));
        assert!(
            h.is_nan() && h.to_bits() & 0x0200 != 0,
            "{bits:#x} -> quiet f16 NaN"
        );
        assert_eq!(h.is_sign_negative(), sign);
    }
    // BF16 signalling NaN widens to a quiet F32 NaN with the same payload.
    let mut w = [0f32];
    bf16_to_f32(&[bf16::from_bits(0xFF81)], &mut w);
    assert_eq!(w[0].to_bits(), 0xFFC1_0000);
}

/// Each BF16 -> F32 kernel this CPU runs gives the portable kernel's bits on every
/// pattern, at every length up to 40 and at unaligned starts (the 16-lane loop and its
/// tail). Machines without AVX-512 run the kernels they have.
#[test]
fn bf16_to_f32_kernels_match_the_portable_kernel() {
    type Kernel = fn(&[bf16], &mut [f32]);
    #[allow(unused_mut)]
    let mut kernels: Vec<(&str, Kernel)> = vec![];
    #[cfg(target_arch = "x86_64")]
    {
        if hemi::cpu::features::Feature::Avx512f.detected()
            && hemi::cpu::features::Feature::Avx512bw.detected()
        {
            kernels.push(("avx512", hemi::dtype::convert::x86::bf16_to_f32_avx512));
        }
        if hemi::cpu::features::Feature::Avx2.detected() {
            kernels.push(("avx2", hemi::dtype::convert::x86::bf16_to_f32_avx2));
        }
    }
    let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut want = vec![0f32; all.len()];
    bf16_to_f32_portable(&all, &mut want);
    for (name, k) in kernels {
        let mut got = vec![0f32; all.len()];
        k(&all, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}: pattern {i:#06x}");
        }
        for start in 0..3 {
            for len in 0..=40 {
                // NaNs, infinities and ordinary values side by side.
                let src: Vec<bf16> = (0..len)
                    .map(|j| all[(start * 977 + j * 4099 + 0x7F7E) % all.len()])
                    .collect();
                let mut got = vec![0f32; len];
                k(&src, &mut got);
                for (j, (g, h)) in got.iter().zip(&src).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        want[h.to_bits() as usize].to_bits(),
                        "{name}: start {start}, len {len}, at {j}"
                    );
                }
            }
        }
    }
}

/// Checks the four F32 <-> F16/BF16 paths against `half`'s scalar conversion on `src`.
fn check_against_scalar(src: &[f32], what: &str) {
    let n = src.len();
    let mut b = vec![bf16::ZERO; n];
    f32_to_bf16(src, &mut b);
    let mut h = vec![f16::ZERO; n];
    f32_to_f16(src, &mut h);
    for i in 0..n {
        let x = src[i];
        assert_eq!(
            b[i].to_bits(),
            bf16::from_f32(x).to_bits(),
            "{what}: f32_to_bf16 at {i} of {n}, input {:#010x}",
            x.to_bits()
        );
        assert_eq!(
            h[i].to_bits(),
            f16::from_f32(x).to_bits(),
            "{what}: f32_to_f16 at {i} of {n}, input {:#010x}",
            x.to_bits()
        );
    }
    let mut w = vec![0f32; n];
    bf16_to_f32(&b, &mut w);
    for i in 0..n {
        assert_eq!(
            w[i].to_bits(),
            b[i].to_f32().to_bits(),
            "{what}: bf16_to_f32 at {i}"
        );
    }
    // Widen arbitrary 16-bit patterns too (the narrowed ones above are biased).
    let halves: Vec<u16> = src.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
    let bh: Vec<bf16> = halves.iter().map(|&x| bf16::from_bits(x)).collect();
    let hh: Vec<f16> = halves.iter().map(|&x| f16::from_bits(x)).collect();
    bf16_to_f32(&bh, &mut w);
    for i in 0..n {
        assert_eq!(
            w[i].to_bits(),
            bh[i].to_f32().to_bits(),
            "{what}: bf16_to_f32 at {i}"
        );
    }
    f16_to_f32(&hh, &mut w);
    for i in 0..n {
        assert_eq!(
            w[i].to_bits(),
            hh[i].to_f32().to_bits(),
            "{what}: f16_to_f32 at {i}"
        );
    }
}

#[test]
fn fast_paths_match_scalar_on_odd_lengths_and_offsets() {
    let mut rng = Rng(0x5EED);
    for &n in &LENGTHS {
        let src = random_f32(&mut rng, n + 3);
        for offset in [0, 1, 3] {
            check_against_scalar(
                &src[offset..offset + n],
                &format!("len {n} offset {offset}"),
            );
        }
    }
    // Destination misaligned relative to the source as well.
    let src = random_f32(&mut rng, 4101);
    let mut b = vec![bf16::ZERO; 4101];
    f32_to_bf16(&src[3..], &mut b[1..4099]);
    for i in 0..4098 {
        assert_eq!(b[i + 1].to_bits(), bf16::from_f32(src[i + 3]).to_bits());
    }
}

#[test]
fn fast_paths_match_scalar_on_long_slices() {
    // Long enough to take the rayon path, with a ragged last chunk.
    let mut rng = Rng(42);
    let src = random_f32(&mut rng, PAR_MIN_LEN + PAR_CHUNK + 5);
    check_against_scalar(&src, "parallel");
}

#[test]
fn bf16_structured_bits_match_scalar() {
    // Every high half combined with low halves that sit on and around the rounding point.
    let lows = [
        0x0000u32, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC000,
    ];
    let src: Vec<f32> = (0..=0xFFFFu32)
        .flat_map(|hi| lows.iter().map(move |&lo| f32::from_bits((hi << 16) | lo)))
        .collect();
    let mut b = vec![bf16::ZERO; src.len()];
    f32_to_bf16(&src, &mut b);
    for (x, y) in src.iter().zip(&b) {
        assert_eq!(
            y.to_bits(),
            bf16::from_f32(*x).to_bits(),
            "input {:#010x}",
            x.to_bits()
        );
    }
}

#[test]
fn every_f32_kernel_agrees_with_scalar() {
    // Each kernel this CPU can run, called directly (the dispatch only ever shows one).
    let mut kernels: Vec<(&str, F32ToBf16)> = vec![("portable", f32_to_bf16_portable)];
    #[cfg(target_arch = "x86_64")]
    {
        if hemi::cpu::features::Feature::Avx2.detected() {
            kernels.push(("avx2", x86::f32_to_bf16_avx2));
        }
        if hemi::cpu::features::Feature::Avx512bf16.detected()
            && hemi::cpu::features::Feature::Avx512f.detected()
        {
            kernels.push(("avx512bf16", x86::f32_to_bf16_avx512bf16));
        } else {
            eprintln!("note: no AVX-512 BF16 on this CPU; its kernel is not exercised");
        }
    }
    let mut rng = Rng(7);
    let src = random_f32(&mut rng, 1 << 16);
    // Every pattern that differs between the instruction and IEEE: the subnormals, and
    // the mix of subnormal and normal inside one 32-element step.
    let subnormals: Vec<f32> = (0..1 << 16)
        .map(|i: u32| f32::from_bits(((i & 1) << 31) | (rng.next_u32() & 0x007F_FFFF)))
        .chain((0..64).map(|i| f32::from_bits(if i == 37 { 0x0000_8001 } else { 0x3F80_8000 })))
        .collect();
    for (name, kernel) in kernels {
        for input in [&src[..], &subnormals[..]] {
            for &n in &LENGTHS {
                for offset in [0, 1, 3] {
                    let s = &input[offset..offset + n];
                    let mut d = vec![bf16::ZERO; n];
                    kernel(s, &mut d);
                    for (x, y) in s.iter().zip(&d) {
                        let want = bf16::from_f32(*x).to_bits();
                        assert_eq!(y.to_bits(), want, "{name}: input {:#010x}", x.to_bits());
                    }
                }
            }
            let mut d = vec![bf16::ZERO; input.len()];
            kernel(input, &mut d);
            for (x, y) in input.iter().zip(&d) {
                let want = bf16::from_f32(*x).to_bits();
                assert_eq!(y.to_bits(), want, "{name}: input {:#010x}", x.to_bits());
            }
        }
    }
}

/// All 2^32 F32 bit patterns through `f32_to_bf16`, against `bf16::from_f32`. A few
/// seconds in release, much longer unoptimised: `cargo test --release` (CI's command)
/// runs it; unoptimised builds skip it.
#[test]
#[cfg_attr(debug_assertions, ignore = "2^32 inputs: run with --release")]
fn every_f32_to_bf16_matches_scalar() {
    const BLOCK: u64 = 1 << 20;
    (0..(1u64 << 32) / BLOCK).into_par_iter().for_each(|blk| {
        let src: Vec<f32> = (blk * BLOCK..(blk + 1) * BLOCK)
            .map(|b| f32::from_bits(b as u32))
            .collect();
        let mut d = vec![bf16::ZERO; src.len()];
        f32_to_bf16(&src, &mut d);
        for (x, y) in src.iter().zip(&d) {
            let want = bf16::from_f32(*x).to_bits();
            assert_eq!(y.to_bits(), want, "input {:#010x}", x.to_bits());
        }
    });
}

// ---- F64 ----

/// Correctly rounded F64 -> 16-bit float, by search over the target's finite values:
/// `value(bits)` for bits in 0..=max_bits is increasing; `inf` is the infinity's bits.
fn reference_round(x: f64, value: impl Fn(u16) -> f64, max_bits: u16, inf: u16) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let a = x.abs();
    if a.is_infinite() {
        return sign | inf;
    }
    // Largest k with value(k) <= a.
    let (mut lo, mut hi) = (0u16, max_bits);
    if a >= value(max_bits) {
        lo = max_bits;
    } else {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if value(mid) <= a {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    let v = value(lo);
    if v == a {
        return sign | lo;
    }
    // Next value up; above the max, inf sits one (virtual) ulp further on.
    let next = if lo == max_bits {
        2.0 * v - value(lo - 1)
    } else {
        value(lo + 1)
    };
    let mid = (v + next) / 2.0; // exact: one more bit than the target has
    let k = if a < mid || (a == mid && lo % 2 == 0) {
        lo
    } else {
        lo + 1
    };
    sign | k.min(inf)
}

fn ref_f16(x: f64) -> u16 {
    reference_round(x, |b| f16::from_bits(b).to_f64(), 0x7BFF, 0x7C00)
}

fn ref_bf16(x: f64) -> u16 {
    reference_round(x, |b| bf16::from_bits(b).to_f64(), 0x7F7F, 0x7F80)
}

/// F64 inputs on, just off and far from the F16 and BF16 ties, plus random patterns.
fn f64_inputs(rng: &mut Rng, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let pick = rng.next_u32() % 4;
        let h = (rng.next_u32() & 0xFFFF) as u16;
        let base = match pick {
            0 => f16::from_bits(h & 0x7BFF).to_f64(),
            1 => bf16::from_bits(h & 0x7F7F).to_f64(),
            _ => f64::from_bits(rng.next_u64()),
        };
        if !base.is_finite() || pick >= 2 {
            out.push(base);
            continue;
        }
        // Move to the midpoint with the next value up, then a few F64 ulps either way.
        let next = if pick == 0 {
            f16::from_bits((h & 0x7BFF) + 1).to_f64()
        } else {
            bf16::from_bits((h & 0x7F7F) + 1).to_f64()
        };
        let mid = (base + next) / 2.0;
        let nudge = (rng.next_u32() % 7) as i64 - 3;
        let sign = if rng.next_u32() & 1 == 1 { -1.0 } else { 1.0 };
        out.push(sign * f64::from_bits((mid.to_bits() as i64 + nudge) as u64));
        // And a value just off the tie by less than F32 can see.
        out.push(sign * (mid + mid * 2f64.powi(-40)));
        out.push(sign * (mid - mid * 2f64.powi(-40)));
    }
    out.truncate(n);
    out
}

#[test]
fn f64_to_half_types_round_once() {
    // half's scalar from_f64 rounds this twice (to F32, then to the tie, then to even).
    let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
    let mut h = [f16::ZERO];
    f64_to_f16(&[x], &mut h);
    assert_eq!(h[0].to_bits(), 0x3C01);
    let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
    let mut b = [bf16::ZERO];
    f64_to_bf16(&[x], &mut b);
    assert_eq!(b[0].to_bits(), 0x3F81);

    let mut rng = Rng(99);
    for &n in LENGTHS.iter().chain(&[100_000]) {
        let src = f64_inputs(&mut rng, n + 1);
        let s = &src[1..];
        let mut h = vec![f16::ZERO; n];
        let mut b = vec![bf16::ZERO; n];
        f64_to_f16(s, &mut h);
        f64_to_bf16(s, &mut b);
        for i in 0..n {
            let x = s[i];
            if x.is_nan() {
                assert!(
                    h[i].is_nan() && h[i].to_bits() & 0x0200 != 0,
                    "{x:e} -> f16"
                );
                assert!(
                    b[i].is_nan() && b[i].to_bits() & 0x0040 != 0,
                    "{x:e} -> bf16"
                );
                assert_eq!(h[i].is_sign_negative(), x.is_sign_negative());
                assert_eq!(b[i].to_bits(), bf16::from_f64(x).to_bits(), "NaN payload");
                continue;
            }
            assert_eq!(
                h[i].to_bits(),
                ref_f16(x),
                "f64_to_f16({x:e}) [{:#x}]",
                x.to_bits()
            );
            assert_eq!(
                b[i].to_bits(),
                ref_bf16(x),
                "f64_to_bf16({x:e}) [{:#x}]",
                x.to_bits()
            );
        }
    }
    // Edges: overflow ties, subnormal ties, beyond F32's range.
    let cases: [(f64, u16, u16); 10] = [
        (65504.0, 0x7BFF, 0x4780),
        (65520.0, 0x7C00, 0x4780),
        (65519.999999, 0x7BFF, 0x4780),
        (2f64.powi(-25), 0x0000, 0x3300),
        (2f64.powi(-25) * (1.0 + 2f64.powi(-50)), 0x0001, 0x3300),
        (2f64.powi(-134), 0x0000, 0x0000), // BF16's half-of-smallest: tie to 0
        (2f64.powi(-134) * (1.0 + 2f64.powi(-50)), 0x0000, 0x0001),
        (1e300, 0x7C00, 0x7F80),
        (-1e-300, 0x8000, 0x8000),
        (f64::from_bits(0x47EF_EFFF_FFFF_FFFF), 0x7C00, 0x7F7F), // just under BF16's inf tie
    ];
    for (x, want_h, want_b) in cases {
        let mut h = [f16::ZERO];
        let mut b = [bf16::ZERO];
        f64_to_f16(&[x], &mut h);
        f64_to_bf16(&[x], &mut b);
        assert_eq!(h[0].to_bits(), want_h, "f64_to_f16({x:e})");
        assert_eq!(b[0].to_bits(), want_b, "f64_to_bf16({x:e})");
        assert_eq!(want_h, ref_f16(x));
        assert_eq!(want_b, ref_bf16(x));
    }
}

#[test]
fn half_types_widen_to_f64_exactly() {
    let hs: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let bs: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut w = vec![0f64; 1 << 16];
    f16_to_f64(&hs, &mut w);
    for (h, x) in hs.iter().zip(&w) {
        if h.is_nan() {
            assert!(x.is_nan());
        } else {
            assert_eq!(x.to_bits(), (h.to_f32() as f64).to_bits());
        }
    }
    bf16_to_f64(&bs, &mut w);
    for (b, x) in bs.iter().zip(&w) {
        if b.is_nan() {
            assert!(x.is_nan());
        } else {
            assert_eq!(x.to_bits(), (b.to_f32() as f64).to_bits());
        }
    }
}

#[test]
#[should_panic(expected = "equal lengths")]
fn length_mismatch_panics() {
    let mut d = [bf16::ZERO; 2];
    f32_to_bf16(&[1.0, 2.0, 3.0], &mut d);
}
