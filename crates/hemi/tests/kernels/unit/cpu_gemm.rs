//! The unit tests of `hemi::cpu::gemm` (`src/cpu/gemm/mod.rs`), run against the built library.

use hemi::cpu::gemm::*;

#[test]
fn strided_product_matches_reference() {
    // a: 3x5 stored transposed (5x3 row-major), b: 5x4 row-major.
    let at: Vec<f64> = (0..15).map(|i| (i as f64 * 0.37).sin()).collect();
    let b: Vec<f64> = (0..20).map(|i| (i as f64 * 0.11).cos()).collect();
    let a = MatRef::row_major(&at, 5, 3).t();
    let bm = MatRef::row_major(&b, 5, 4);
    let want = matmul_reference(a, bm);
    let mut got = vec![0.0; 12];
    matmul_into(&mut got, a, bm, false);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-12);
    }
    let a32: Vec<f32> = at.iter().map(|&x| x as f32).collect();
    let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
    let mut got32 = vec![1.0f32; 12];
    matmul_into(
        &mut got32,
        MatRef::row_major(&a32, 5, 3).t(),
        MatRef::row_major(&b32, 5, 4),
        true,
    );
    for (g, w) in got32.iter().zip(&want) {
        assert!((f64::from(*g) - (w + 1.0)).abs() < 1e-5);
    }
}
