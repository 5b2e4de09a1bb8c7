//! Mapping hemi's row-major batched matmul onto cuBLAS's column-major GEMM.
//!
//! cuBLAS reads a matrix X (rows r, cols c) as column-major with leading dimension ld: element
//! (i, j) at `i + j*ld`. A row-major r x c matrix with row stride s is, read that way, its
//! transpose (c x r, ld = s). So for `C = A·B` with row-major C the trick is `Cᵀ = Bᵀ·Aᵀ`:
//! swap the operands and the roles of m and n, and every row-major operand is "op N".
//! A transposed view (column stride ≠ 1, row stride 1) is column-major already and becomes
//! "op T". Anything else (neither stride 1) cannot be described to cuBLAS: the caller must make
//! a contiguous copy first. The result is the argument list of `cublasGemmStridedBatchedEx`
//! (the same numbers describe cuBLASLt matrix layouts: rows, cols, ld, batch stride).

use crate::dtype::DType;
use crate::error::{Error, Result};

/// A row-major matrix operand as hemi describes it: its logical shape and element strides
/// (row, column, batch). A batch stride of 0 broadcasts one matrix to every batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatView {
    /// Number of rows of the logical (row-major) matrix.
    pub rows: usize,
    /// Number of columns of the logical matrix.
    pub cols: usize,
    /// Elements between consecutive rows.
    pub row_stride: i64,
    /// Elements between consecutive columns (1 when rows are contiguous).
    pub col_stride: i64,
    /// Elements between consecutive matrices of a batch (0: one matrix broadcast to all).
    pub batch_stride: i64,
}

impl MatView {
    /// A contiguous row-major `rows x cols` matrix, batches packed one after the other.
    pub fn contiguous(rows: usize, cols: usize) -> Self {
        MatView {
            rows,
            cols,
            row_stride: cols as i64,
            col_stride: 1,
            batch_stride: (rows * cols) as i64,
        }
    }

    /// Elements of storage the view spans over `batch` matrices (the largest offset + 1), or
    /// `None` for a negative stride or on overflow. 0 for an empty view.
    pub fn extent(&self, batch: usize) -> Option<u64> {
        if self.rows == 0 || self.cols == 0 || batch == 0 {
            return Some(0);
        }
        let part = |n: usize, s: i64| -> Option<u64> {
            (n as u64 - 1).checked_mul(u64::try_from(s).ok()?)
        };
        part(batch, self.batch_stride)?
            .checked_add(part(self.rows, self.row_stride)?)?
            .checked_add(part(self.cols, self.col_stride)?)?
            .checked_add(1)
    }

    /// The transposed view (`.t()`): swaps shape and strides, no data moves.
    pub fn t(self) -> Self {
        MatView {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// cuBLAS's `cublasOperation_t`, the subset used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Not transposed (`CUBLAS_OP_N`).
    N,
    /// Transposed (`CUBLAS_OP_T`).
    T,
}

/// `cudaDataType` of an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmType {
    /// CUDA_R_16F
    F16,
    /// CUDA_R_16BF
    BF16,
    /// CUDA_R_32F
    F32,
}

impl GemmType {
    /// The cuBLAS type of an F16, BF16 or F32 operand; other dtypes are an [`Error::DType`]
    /// for `op`.
    pub fn of(op: &'static str, dtype: DType) -> Result<Self> {
        match dtype {
            DType::F16 => Ok(GemmType::F16),
            DType::BF16 => Ok(GemmType::BF16),
            DType::F32 => Ok(GemmType::F32),
            d => Err(Error::dtype(op, d, "cuBLAS GEMM takes F16, BF16 or F32")),
        }
    }
}

/// The arguments of `cublasGemmStridedBatchedEx`, with the compute type fixed to
/// `CUBLAS_COMPUTE_32F` (F32 accumulation whatever the storage type), alpha = 1, beta = 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmArgs {
    /// cuBLAS's A slot holds hemi's B (and its B slot hemi's A) when true: the row-major
    /// output case, `Cᵀ = Bᵀ·Aᵀ`.
    pub swap_operands: bool,
    /// cuBLAS's `transa`: how its A slot is read (column-major).
    pub transa: Op,
    /// cuBLAS's `transb`: how its B slot is read (column-major).
    pub transb: Op,
    /// Rows of cuBLAS's (column-major) output.
    pub m: i32,
    /// Columns of cuBLAS's (column-major) output.
    pub n: i32,
    /// The reduction length.
    pub k: i32,
    /// Leading dimension of the A slot, in elements.
    pub lda: i32,
    /// Leading dimension of the B slot, in elements.
    pub ldb: i32,
    /// Leading dimension of the output, in elements.
    pub ldc: i32,
    /// Elements between consecutive A-slot matrices of the batch (0: broadcast).
    pub stride_a: i64,
    /// Elements between consecutive B-slot matrices of the batch (0: broadcast).
    pub stride_b: i64,
    /// Elements between consecutive output matrices.
    pub stride_c: i64,
    /// Number of products in the batch.
    pub batch: i32,
    /// Storage type of the A slot.
    pub a_type: GemmType,
    /// Storage type of the B slot.
    pub b_type: GemmType,
    /// Storage type of the output.
    pub c_type: GemmType,
}

const OP: &str = "cuda gemm";

fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::arg(
            OP,
            format!("{what} = {v} exceeds cuBLAS's 32-bit limit (split the matmul)"),
        )
    })
}

/// How cuBLAS sees a column-major operand that must act as `rows x cols`: op and ld.
/// `name` is for messages.
fn operand(name: &str, v: MatView) -> Result<(Op, usize)> {
    if v.row_stride < 0 || v.col_stride < 0 || v.batch_stride < 0 {
        return Err(Error::arg(
            OP,
            format!("{name} has a negative stride {v:?}; cuBLAS cannot express it, make a contiguous copy first"),
        ));
    }
    let (r, c) = (v.rows, v.cols);
    let (rs, cs) = (v.row_stride as usize, v.col_stride as usize);
    // Column-major already (rows adjacent): op N, ld = column stride.
    if rs == 1 || r <= 1 {
        let ld = if c <= 1 { r.max(1) } else { cs };
        if ld >= r.max(1) {
            return Ok((Op::N, ld));
        }
    }
    // Row-major (columns adjacent): memory read column-major is the transpose, op T,
    // ld = row stride.
    if cs == 1 || c <= 1 {
        let ld = if r <= 1 { c.max(1) } else { rs };
        if ld >= c.max(1) {
            return Ok((Op::T, ld));
        }
    }
    Err(Error::arg(
        OP,
        format!(
            "{name} is a {r}x{c} view with strides (row {rs}, col {cs}): cuBLAS needs one of them \
             to be 1 and the other at least the matching extent; make a contiguous copy first"
        ),
    ))
}

/// Maps the row-major batched `C[b] = A[b]·B[b]` (A: m x k, B: k x n, C: m x n, `batch`
/// matrices) to cuBLAS arguments; errors name the operand and what cuBLAS cannot express.
/// `in_dtype` is the dtype of A and B, `out_dtype` of C (the same, or F32).
pub fn map_gemm(
    a: MatView,
    b: MatView,
    c: MatView,
    batch: usize,
    in_dtype: DType,
    out_dtype: DType,
) -> Result<GemmArgs> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || c.rows != m || c.cols != n {
        return Err(Error::shape(
            OP,
            format!(
                "[{}, {}] x [{}, {}] -> [{}, {}]",
                a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
            ),
        ));
    }
    let in_t = GemmType::of(OP, in_dtype)?;
    let out_t = GemmType::of(OP, out_dtype)?;
    if out_dtype != in_dtype && out_dtype != DType::F32 {
        return Err(Error::dtype(
            OP,
            out_dtype,
            format!("output must be {in_dtype:?} (the input dtype) or F32"),
        ));
    }
    if batch == 0 || m == 0 || n == 0 {
        return Err(Error::arg(
            OP,
            "empty output: nothing for cuBLAS to do (the caller skips the launch)",
        ));
    }
    if k == 0 {
        return Err(Error::arg(
            OP,
            "k = 0: the product is all zeros (the caller fills instead of calling cuBLAS)",
        ));
    }
    // Column-major C directly; row-major C as the transposed problem Cᵀ = Bᵀ·Aᵀ.
    let c_col = c.row_stride == 1 || m == 1;
    let (swap, p, q, cc) = if c_col && c.col_stride >= m as i64 && (n == 1 || c.col_stride > 0) {
        (false, a, b, c)
    } else {
        (true, b.t(), a.t(), c.t())
    };
    // Now cc must be column-major: rows adjacent.
    let (rows, cols) = (cc.rows, cc.cols);
    if !(cc.row_stride == 1 || rows == 1) || cc.col_stride < 0 || cc.batch_stride < 0 {
        return Err(Error::arg(
            OP,
            format!(
                "the output view (strides row {}, col {}) is neither row- nor column-major; \
                 write into a contiguous buffer and copy",
                c.row_stride, c.col_stride
            ),
        ));
    }
    let ldc = if cols <= 1 {
        rows
    } else {
        cc.col_stride as usize
    };
    if ldc < rows {
        return Err(Error::arg(
            OP,
            format!("the output's leading dimension {ldc} is less than its {rows} rows (overlapping output)"),
        ));
    }
    let stride_c = cc.batch_stride as usize;
    if batch > 1 && stride_c < ldc * (cols - 1) + rows {
        return Err(Error::arg(
            OP,
            format!("output batch stride {stride_c} makes the {batch} output matrices overlap"),
        ));
    }
    let (transa, lda) = operand(if swap { "B" } else { "A" }, p)?;
    let (transb, ldb) = operand(if swap { "A" } else { "B" }, q)?;
    Ok(GemmArgs {
        swap_operands: swap,
        transa,
        transb,
        m: to_i32("m", rows)?,
        n: to_i32("n", cols)?,
        k: to_i32("k", k)?,
        lda: to_i32("lda", lda)?,
        ldb: to_i32("ldb", ldb)?,
        ldc: to_i32("ldc", ldc)?,
        stride_a: p.batch_stride,
        stride_b: q.batch_stride,
        stride_c: cc.batch_stride,
        batch: to_i32("batch", batch)?,
        a_type: in_t,
        b_type: in_t,
        c_type: out_t,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
