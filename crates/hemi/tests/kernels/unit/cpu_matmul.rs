//! The unit tests of `hemi::cpu::gemm::matmul` (`src/cpu/gemm/matmul.rs`), run against the built library.

use hemi::cpu::gemm::matmul::*;

/// Bias rows and zeros, below and above the parallel size, with row lengths that do not
/// divide a part, in a pool of 3 and on one thread.
#[test]
fn filled_rows_repeat_the_bias_or_zeros() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for (rows, n) in [(3, 5), (1, 1), (2049, 383), (997, 1537), (5, 40_000)] {
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.5 - 7.0).collect();
        for threads in [
            &pool,
            &rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap(),
        ] {
            let with = threads.install(|| filled_rows(rows, n, Some(&bias)));
            assert_eq!(with.len(), rows * n);
            for (r, row) in with.chunks(n).enumerate() {
                assert_eq!(row, &bias[..], "row {r} of {rows}x{n}");
            }
            let zeros: Vec<f64> = threads.install(|| filled_rows(rows, n, None));
            assert_eq!(zeros.len(), rows * n);
            assert!(zeros.iter().all(|&z| z == 0.0), "zeros {rows}x{n}");
        }
    }
    assert!(filled_rows::<f32>(0, 7, None).is_empty());
}
