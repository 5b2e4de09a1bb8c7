//! The unit tests of `hemi::cpu::norm::in_place` (`src/cpu/norm/in_place.rs`), run against the built library.

use half::{bf16, f16};
use hemi::cpu::chunked;
use hemi::cpu::norm::in_place::*;
use hemi::dtype::WithDType;

/// The kernels' stores round as `convert` does (`chunked::write`), bit for bit, on random
/// bit patterns and on the values where rounding goes wrong first: ties to even, the
/// largest finite values, subnormals, infinities, signalling and quiet NaN.
#[test]
fn stores_round_as_convert_does() {
    for level in [Level::Avx512, Level::Avx2] {
        if level.is_available() {
            stores_round_as_convert_does_at(level);
        }
    }
}

fn stores_round_as_convert_does_at(level: Level) {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut bits: Vec<u32> = (0..4099)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 16) as u32
        })
        .collect();
    for b in [
        0x3F80_8000, // 1 + 2^-8: a BF16 tie, rounds to even (down)
        0x3F81_8000, // a BF16 tie that rounds up
        0x3F80_1000, // 1 + 2^-11: an F16 tie
        0x3F80_3000,
        0x7F7F_FFFF, // largest finite F32: BF16 and F16 overflow
        0x477F_E000, // F16's rounding edge to inf
        0x0000_0001, // smallest subnormal
        0x807F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001, // signalling NaN
        0xFFC1_2345, // quiet NaN with payload
        0x0000_0000,
        0x8000_0000,
    ] {
        bits.push(b);
    }
    let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    fn check<T: WithDType>(level: Level, src: &[f32]) {
        for n in [src.len(), 17, 8, 5] {
            let src = &src[src.len() - n..];
            let mut want = vec![T::default(); n];
            chunked::write(src, &mut want);
            let mut got = vec![T::default(); n];
            // SAFETY: `level.is_available()` (checked by the caller); equal lengths.
            unsafe { round_into(level, src, uninit(&mut got)) };
            let bytes = |v: &[T]| {
                let mut out = vec![];
                v.iter().for_each(|&x| x.write_le(&mut out));
                out
            };
            assert_eq!(bytes(&got), bytes(&want), "{level:?} {:?}, n {n}", T::DTYPE);
        }
    }
    check::<f32>(level, &src);
    check::<f16>(level, &src);
    check::<bf16>(level, &src);
}
