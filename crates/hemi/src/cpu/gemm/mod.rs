//! Matrix products: every CPU GEMM and what it needs.
//!
//! This file: products on strided row-major views (`MatRef`), the `gemm` crate in the
//! compute type (F32 or F64), and `product`, which picks it or hemi's own GEMM (`blocked`,
//! F32 accumulation, half-precision operands converted inside its packing) by the element
//! types of the operands. Used by matmul, linear and convolution. The rest of the family:
//! - `blocked`: hemi's blocked GEMM (entry points, threads, the driver); `select` (which
//!   kernel), `pack` (panels, `PackedA`), `unfold` (B packed from a convolution's image),
//!   `portable` and `x86` (the microkernels);
//! - `matmul`: batched matmul over tensor layouts (broadcast batch dims, bias rows, the
//!   F16/BF16 output rounded tile by tile).

pub mod blocked;
pub mod matmul;
pub mod pack;
mod portable;
pub mod select;
pub mod unfold;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::dtype::{same_slice, DType, FloatDType, WithDType};

/// A strided read-only matrix view of elements `T` (any storage dtype): element (i, j) is at
/// `data[i * rs + j * cs]`. The one view type of every CPU GEMM (`gemm`, `blocked`) and of
/// the convolutions.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    /// The elements; the view reads only those its shape and strides address.
    pub data: &'a [T],
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// Row stride, in elements (may be negative or 0).
    pub rs: isize,
    /// Column stride, in elements (may be negative or 0).
    pub cs: isize,
}

impl<'a, T> MatRef<'a, T> {
    /// A row-major contiguous `rows x cols` matrix.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        debug_assert!(data.len() >= rows * cols);
        MatRef {
            data,
            rows,
            cols,
            rs: cols as isize,
            cs: 1,
        }
    }
    /// The transpose, without copying.
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
    /// The same view with row stride `rs`.
    pub fn with_row_stride(self, rs: isize) -> Self {
        MatRef { rs, ..self }
    }
    fn max_index(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        (self.rows - 1) * self.rs as usize + (self.cols - 1) * self.cs as usize
    }
    /// Offset of element (i, j) in `data`.
    pub(crate) fn offset(&self, i: usize, j: usize) -> isize {
        i as isize * self.rs + j as isize * self.cs
    }

    /// Panics unless every element of the view lies inside `data`: after this, the offsets
    /// the packing computes are in bounds.
    pub(crate) fn check_bounds(&self, what: &str) {
        if self.rows == 0 || self.cols == 0 {
            return;
        }
        let span = |n: usize, s: isize| (n as isize - 1).checked_mul(s);
        let (Some(di), Some(dj)) = (span(self.rows, self.rs), span(self.cols, self.cs)) else {
            panic!("gemm_half: {what} strides overflow");
        };
        let lo = di.min(0) + dj.min(0);
        let hi = di.max(0).checked_add(dj.max(0));
        assert!(
            lo >= 0 && hi.is_some_and(|hi| (hi as usize) < self.data.len()),
            "gemm_half: {what} view {}x{} (strides {}, {}) out of bounds of {} elements",
            self.rows,
            self.cols,
            self.rs,
            self.cs,
            self.data.len()
        );
    }
}

impl<'a, T: WithDType> MatRef<'a, T> {
    /// The storage dtype of the elements.
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }
    /// The same view with elements of type `U`, when `U` is `T`.
    pub fn cast<U: WithDType>(self) -> Option<MatRef<'a, U>> {
        Some(MatRef {
            data: same_slice(self.data)?,
            rows: self.rows,
            cols: self.cols,
            rs: self.rs,
            cs: self.cs,
        })
    }
}

/// `dst = [dst +] a · b` in the compute type `C`, `dst` row-major contiguous
/// `a.rows x b.cols`: the `gemm` crate when both operands are of type `C`, else hemi's GEMM
/// (`blocked`: F32, F16 and BF16 operands in any mix, F32 accumulation, so `C` is f32
/// there). `par` lets the product use the thread pool (pass false inside a parallel task);
/// the thread count changes no bit of the result.
pub fn product<C: FloatDType, A: WithDType, B: WithDType>(
    dst: &mut [C],
    a: MatRef<'_, A>,
    b: MatRef<'_, B>,
    acc: bool,
    par: bool,
) {
    match (a.cast::<C>(), b.cast::<C>()) {
        (Some(a), Some(b)) => {
            // F32 on hemi's GEMM where it has the better kernel (AVX-512 on stable Rust).
            if let (Some(d), Some(a32), Some(b32)) =
                (C::as_f32_mut(dst), a.cast::<f32>(), b.cast::<f32>())
            {
                if let Some(kernel) = select::f32_kernel(a.rows, a.cols, b.cols) {
                    return blocked::gemm_with(kernel, d, a32, b32, acc, par);
                }
            }
            matmul_into_par(dst, a, b, acc, par)
        }
        _ => {
            let dst = C::as_f32_mut(dst).expect("half-precision operands: F32 compute");
            blocked::gemm(dst, a, b, acc, par)
        }
    }
}

/// The kernel `product` would run an `m × k · k × n` F32 product on, where that is one of
/// hemi's F32-panel kernels, which can read a convolution's column matrix straight from its
/// image (`blocked::gemm_unfold`); `None` where it would be the `gemm` crate (F64, shapes
/// `select::f32_kernel` leaves to it) and for F16/BF16 operands: converting F16 step by
/// step in the unfold made ResNet-20's amp-fp16 step 5 % slower than im2col + pack, and
/// BF16 on a pair kernel is unfolded in channel pairs instead (`cpu::conv`'s `PairConv`).
pub(crate) fn unfold_kernel<C: FloatDType, T: WithDType>(
    m: usize,
    k: usize,
    n: usize,
) -> Option<select::Kernel> {
    if C::DTYPE != DType::F32 || T::DTYPE != DType::F32 {
        return None;
    }
    select::f32_kernel(m, k, n).filter(|k| k.packs_f32())
}

/// Threads `gemm` may use for a product of this size (small products stay on one thread).
///
/// The thread count changes no bit of the result: `gemm` (0.19, `gemm-common`'s
/// `gemm_basic_generic`) splits only the output's rows and columns among threads, and cuts
/// k into blocks whose size comes from the shape and the cache sizes, added into the
/// output one after another; each microkernel sums its k block in order into one register
/// per element (`tests/kernels/threads.rs` holds it to that).
fn parallelism(m: usize, n: usize, k: usize) -> gemm::Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 && m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst = beta * dst + a * b` with `dst` row-major contiguous `a.rows x b.cols`;
/// `beta` is 0 (overwrite) or 1 (accumulate).
pub fn matmul_into<C: FloatDType>(
    dst: &mut [C],
    a: MatRef<'_, C>,
    b: MatRef<'_, C>,
    accumulate: bool,
) {
    matmul_into_par(dst, a, b, accumulate, true)
}

/// As `matmul_into`; `allow_parallel = false` keeps gemm on the calling thread (for callers
/// that already parallelise over a batch).
pub fn matmul_into_par<C: FloatDType>(
    dst: &mut [C],
    a: MatRef<'_, C>,
    b: MatRef<'_, C>,
    accumulate: bool,
    allow_parallel: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "gemm: inner dims");
    assert!(dst.len() >= m * n, "gemm: dst too small");
    assert!(
        a.data.len() > a.max_index() || m * k == 0,
        "gemm: lhs out of bounds"
    );
    assert!(
        b.data.len() > b.max_index() || k * n == 0,
        "gemm: rhs out of bounds"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].iter_mut().for_each(|x| *x = C::zero());
        }
        return;
    }
    let par = if allow_parallel {
        parallelism(m, n, k)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above keep every index the views address inside their slices,
    // and `dst` holds m*n elements with row stride n; gemm reads/writes only those. `gemm`
    // dispatches on the element type at run time (f32 and f64 here).
    unsafe {
        gemm::gemm::<C>(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs,
            a.rs,
            b.data.as_ptr(),
            b.cs,
            b.rs,
            C::one(),
            C::one(),
            false,
            false,
            false,
            par,
        );
    }
}

/// Plain reference product (f64 accumulation), for tests of the fast paths.
pub fn matmul_reference(a: MatRef<'_, f64>, b: MatRef<'_, f64>) -> Vec<f64> {
    let mut out = vec![0.0; a.rows * b.cols];
    for i in 0..a.rows {
        for j in 0..b.cols {
            let mut s = 0.0;
            for p in 0..a.cols {
                s += a.data[(i as isize * a.rs + p as isize * a.cs) as usize]
                    * b.data[(p as isize * b.rs + j as isize * b.cs) as usize];
            }
            out[i * b.cols + j] = s;
        }
    }
    out
}
