//! The unit tests of `hemi::cpu::conv::block` (`src/cpu/conv/block.rs`), run against the built library.

use hemi::cpu::conv::block::*;
use hemi::cpu::conv::Conv2dGeom;
use hemi::rng::Generator;

/// The vector kernel equals the plain loop bit for bit (values and window indices) on
/// random images with ties, NaNs, infinities and all-negative windows, for widths
/// that leave every tail length.
#[test]
fn fast_row_pairs_equal_the_plain_loop() {
    let mut rng = Generator::new(5);
    for (ho, wo) in [(2, 2), (5, 17), (4, 16), (7, 33), (6, 40), (3, 63)] {
        let g = Conv2dGeom {
            n: 1,
            c_in: 1,
            h: ho,
            w: wo,
            c_out: 3,
            kh: 1,
            kw: 1,
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
            h_out: ho,
            w_out: wo,
        };
        // Few distinct values so that ties are common.
        let y: Vec<f32> = (0..3 * ho * wo)
            .map(|_| match rng.below(12) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => f32::INFINITY,
                k => (k as f32 - 7.0) * 0.5,
            })
            .collect();
        let n = pooled_image(&g);
        let (mut o1, mut i1) = (vec![0f32; n], vec![0u8; n]);
        let (mut o2, mut i2) = (vec![0f32; n], vec![0u8; n]);
        let ld = ho * wo;
        relu_pool_image(&y, ld, &mut o1, &mut i1, &g, true);
        relu_pool_image(&y, ld, &mut o2, &mut i2, &g, false);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&o1), bits(&o2), "{ho}x{wo}");
        assert_eq!(i1, i2, "{ho}x{wo}");
    }
}
