//! The unit tests of `hemi::cuda::gemm` (`src/cuda/gemm.rs`), run against the built library.

use hemi::cuda::gemm::*;
use hemi::dtype::DType;
use hemi::error::Error;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

/// A column-major strided-batched GEMM that reads exactly the cuBLAS arguments:
/// `C[p] = op(A[p]) · op(B[p])` (alpha 1, beta 0), op(X)(i, l) = X[i + l*ld] for N,
/// X[l + i*ld] for T.
fn reference_cublas(g: &GemmArgs, a: &[f64], b: &[f64], c: &mut [f64]) {
    let at = |x: &[f64], op: Op, ld: i32, s: i64, p: usize, i: usize, l: usize| {
        let off = p as i64 * s;
        let idx = match op {
            Op::N => i + l * ld as usize,
            Op::T => l + i * ld as usize,
        };
        x[(off + idx as i64) as usize]
    };
    for p in 0..g.batch as usize {
        for i in 0..g.m as usize {
            for j in 0..g.n as usize {
                let mut acc = 0.0;
                for l in 0..g.k as usize {
                    acc += at(a, g.transa, g.lda, g.stride_a, p, i, l)
                        * at(b, g.transb, g.ldb, g.stride_b, p, l, j);
                }
                c[(p as i64 * g.stride_c) as usize + i + j * g.ldc as usize] = acc;
            }
        }
    }
}

/// Memory for a logical batch of `rows x cols` matrices in one of several layouts; the
/// view describing it. `logical[p][i][j]` is stored at the view's address.
#[derive(Clone, Copy, Debug)]
enum Layout {
    RowMajor,
    Transposed,
    PaddedRows(usize),
    PaddedTransposed(usize),
    Broadcast,
}

fn store(logical: &[Vec<Vec<f64>>], layout: Layout) -> (Vec<f64>, MatView) {
    let batch = logical.len();
    let (r, c) = (logical[0].len(), logical[0][0].len());
    let (rs, cs, per) = match layout {
        Layout::RowMajor | Layout::Broadcast => (c, 1, r * c),
        Layout::Transposed => (1, r, r * c),
        Layout::PaddedRows(p) => (c + p, 1, r * (c + p) + 3),
        Layout::PaddedTransposed(p) => (1, r + p, c * (r + p) + 1),
    };
    let (bs, nb) = match layout {
        Layout::Broadcast => (0, 1),
        _ => (per, batch),
    };
    let mut mem = vec![f64::NAN; per * nb + 8];
    for (p, mat) in logical.iter().enumerate().take(nb) {
        for i in 0..r {
            for j in 0..c {
                mem[p * bs + i * rs + j * cs] = mat[i][j];
            }
        }
    }
    let view = MatView {
        rows: r,
        cols: c,
        row_stride: rs as i64,
        col_stride: cs as i64,
        batch_stride: bs as i64,
    };
    (mem, view)
}

fn random(
    rng: &mut Xoshiro256PlusPlus,
    batch: usize,
    r: usize,
    c: usize,
    same: bool,
) -> Vec<Vec<Vec<f64>>> {
    let one = |rng: &mut Xoshiro256PlusPlus| -> Vec<Vec<f64>> {
        (0..r)
            .map(|_| (0..c).map(|_| rng.random_range(-1.0..1.0)).collect())
            .collect()
    };
    if same {
        let m = one(rng);
        vec![m; batch]
    } else {
        (0..batch).map(|_| one(rng)).collect()
    }
}

#[test]
fn cublas_arguments_reproduce_row_major_matmul_for_every_layout() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(12);
    let layouts = [
        Layout::RowMajor,
        Layout::Transposed,
        Layout::PaddedRows(3),
        Layout::PaddedTransposed(2),
        Layout::Broadcast,
    ];
    let mut cases = 0;
    for &(batch, m, k, n) in &[
        (1, 1, 1, 1),
        (3, 5, 7, 3),
        (2, 1, 9, 4),
        (2, 6, 1, 5),
        (4, 7, 3, 1),
        (1, 13, 11, 17),
    ] {
        for la in layouts {
            for lb in layouts {
                for lc in [
                    Layout::RowMajor,
                    Layout::Transposed,
                    Layout::PaddedRows(2),
                    Layout::PaddedTransposed(1),
                ] {
                    let a = random(&mut rng, batch, m, k, matches!(la, Layout::Broadcast));
                    let b = random(&mut rng, batch, k, n, matches!(lb, Layout::Broadcast));
                    let (am, av) = store(&a, la);
                    let (bm, bv) = store(&b, lb);
                    let zero = vec![vec![vec![0.0; n]; m]; batch];
                    let (mut cm, cv) = store(&zero, lc);
                    let g = map_gemm(av, bv, cv, batch, DType::F16, DType::F32)
                        .unwrap_or_else(|e| panic!("{la:?} {lb:?} {lc:?}: {e}"));
                    assert!(g.lda >= 1 && g.ldb >= 1 && g.ldc >= g.m);
                    let (x, y) = if g.swap_operands {
                        (&bm, &am)
                    } else {
                        (&am, &bm)
                    };
                    reference_cublas(&g, x, y, &mut cm);
                    for p in 0..batch {
                        for i in 0..m {
                            for j in 0..n {
                                let want: f64 = (0..k).map(|l| a[p][i][l] * b[p][l][j]).sum();
                                let got = cm[(p as i64 * cv.batch_stride
                                    + i as i64 * cv.row_stride
                                    + j as i64 * cv.col_stride)
                                    as usize];
                                assert!((got - want).abs() <= 1e-12 * (1.0 + want.abs()), "{la:?} {lb:?} {lc:?} b{batch} {m}x{k}x{n}: [{p},{i},{j}] {got} vs {want}");
                            }
                        }
                    }
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 6 * 5 * 5 * 4);
}

#[test]
fn row_major_output_swaps_operands_with_op_n() {
    let g = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        2,
        DType::BF16,
        DType::BF16,
    )
    .unwrap();
    assert!(g.swap_operands);
    assert_eq!((g.transa, g.transb), (Op::N, Op::N));
    assert_eq!((g.m, g.n, g.k), (5, 4, 3));
    assert_eq!((g.lda, g.ldb, g.ldc), (5, 3, 5));
    assert_eq!((g.stride_a, g.stride_b, g.stride_c), (15, 12, 20));
    assert_eq!((g.a_type, g.c_type), (GemmType::BF16, GemmType::BF16));
    // A transposed view of A becomes op T on cuBLAS's B slot.
    let g = map_gemm(
        MatView::contiguous(3, 4).t(),
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F16,
        DType::F32,
    )
    .unwrap();
    assert_eq!((g.transa, g.transb, g.ldb), (Op::N, Op::T, 4));
}

#[test]
fn views_cublas_cannot_express_ask_for_a_contiguous_copy() {
    let strided = MatView {
        rows: 4,
        cols: 3,
        row_stride: 6,
        col_stride: 2,
        batch_stride: 24,
    };
    let e = map_gemm(
        strided,
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F16,
        DType::F16,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("contiguous copy") && e.contains("A"), "{e}");
    let neg = MatView {
        row_stride: -3,
        ..MatView::contiguous(4, 3)
    };
    let e = map_gemm(
        neg,
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F16,
        DType::F16,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("negative stride"), "{e}");
    // Leading dimension shorter than the rows: rows would overlap.
    let short = MatView {
        rows: 4,
        cols: 3,
        row_stride: 2,
        col_stride: 1,
        batch_stride: 12,
    };
    let e = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F16,
        DType::F16,
    )
    .and_then(|_| {
        map_gemm(
            short,
            MatView::contiguous(3, 5),
            MatView::contiguous(4, 5),
            1,
            DType::F16,
            DType::F16,
        )
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("contiguous copy"), "{e}");
    // Output batches overlapping.
    let c = MatView {
        batch_stride: 7,
        ..MatView::contiguous(4, 5)
    };
    let e = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(3, 5),
        c,
        2,
        DType::F16,
        DType::F16,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("overlap"), "{e}");
    // Output neither row- nor column-major.
    let c = MatView {
        rows: 4,
        cols: 5,
        row_stride: 10,
        col_stride: 2,
        batch_stride: 40,
    };
    let e = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(3, 5),
        c,
        1,
        DType::F16,
        DType::F16,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("output"), "{e}");
}

#[test]
fn extents_bound_the_storage_a_view_reads() {
    assert_eq!(MatView::contiguous(4, 3).extent(2), Some(24));
    assert_eq!(MatView::contiguous(4, 3).t().extent(1), Some(12));
    let bc = MatView {
        batch_stride: 0,
        ..MatView::contiguous(4, 3)
    };
    assert_eq!(bc.extent(5), Some(12));
    assert_eq!(MatView::contiguous(0, 3).extent(5), Some(0));
    assert_eq!(
        MatView {
            row_stride: -1,
            ..MatView::contiguous(4, 3)
        }
        .extent(1),
        None
    );
    assert_eq!(
        MatView {
            batch_stride: i64::MAX,
            ..MatView::contiguous(4, 3)
        }
        .extent(3),
        None
    );
}

#[test]
fn shapes_dtypes_and_limits_are_checked() {
    let e = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(4, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F16,
        DType::F16,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let e = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F64,
        DType::F64,
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let e = map_gemm(
        MatView::contiguous(4, 3),
        MatView::contiguous(3, 5),
        MatView::contiguous(4, 5),
        1,
        DType::F16,
        DType::BF16,
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let big = 1usize << 31;
    let e = map_gemm(
        MatView::contiguous(2, big),
        MatView::contiguous(big, 2),
        MatView::contiguous(2, 2),
        1,
        DType::F16,
        DType::F32,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("32-bit"), "{e}");
    let e = map_gemm(
        MatView::contiguous(0, 3),
        MatView::contiguous(3, 5),
        MatView::contiguous(0, 5),
        1,
        DType::F16,
        DType::F16,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("empty"), "{e}");
}
