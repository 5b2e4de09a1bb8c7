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
