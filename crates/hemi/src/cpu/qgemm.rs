//! INT8 GEMM: `C[m, n] = Σ_k A[m, k] · W[n, k]` with A unsigned 8-bit activations (row-major,
//! row stride `lda`), W signed 8-bit weights (`[n, k]`, PyTorch's `[out, in]`), sums in
//! exact 32-bit integers, then an epilogue applied per output tile (`Epilogue`).
//!
//! The quantised layers of `quant` call this: activations are affine u8 (scale, zero point
//! per row or per tensor), weights symmetric s8 per output channel (zero point 0), so the
//! zero-point correction is `-a_zero[i] · colsum[j]` where `colsum[j] = Σ_k W[j, k]` is
//! computed once, when the weights are packed (`PackedB`).
//!
//! Kernels (`QKernel`), chosen at run time:
//! - `portable`: plain Rust, any CPU; the reference the others are tested against.
//!
//! Integer sums are exact: `|a·w| ≤ 255 · 128`, so k up to 65 793 (2³¹ / 32 640) cannot
//! overflow; `PackedB::new` rejects larger k.

use crate::error::{Error, Result};

/// The largest reduction length whose sums provably fit in i32: `k · 255 · 128 < 2³¹`.
pub const MAX_K: usize = (i32::MAX as usize) / (255 * 128);

/// An INT8 microkernel with its packed weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QKernel {
    /// Plain Rust over the unpacked rows: any CPU.
    Portable,
}

impl QKernel {
    /// Every kernel, portable first.
    pub const ALL: [QKernel; 1] = [QKernel::Portable];

    /// The kernel's name as `hemi bench matmul` prints it.
    pub fn name(self) -> &'static str {
        match self {
            QKernel::Portable => "portable-i8",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            QKernel::Portable => true,
        }
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> QKernel {
        QKernel::Portable
    }
}

/// Weights `[n, k]` (s8) packed for one kernel, with their row sums `Σ_k W[j, k]`.
#[derive(Clone, Debug)]
pub struct PackedB {
    n: usize,
    k: usize,
    kernel: QKernel,
    data: Vec<i8>,
    col_sums: Vec<i32>,
}

impl PackedB {
    /// Packs row-major `w` (`[n, k]`) for the fastest kernel of this CPU.
    pub fn new(w: &[i8], n: usize, k: usize) -> Result<PackedB> {
        PackedB::with_kernel(w, n, k, QKernel::best())
    }

    /// Packs `w` for `kernel` (which this CPU must be able to run).
    pub fn with_kernel(w: &[i8], n: usize, k: usize, kernel: QKernel) -> Result<PackedB> {
        if w.len() != n * k {
            return Err(Error::shape(
                "qgemm pack",
                format!("{} weights for [{n}, {k}]", w.len()),
            ));
        }
        if k > MAX_K {
            return Err(Error::shape(
                "qgemm pack",
                format!("k = {k} exceeds {MAX_K}, where i32 sums could overflow"),
            ));
        }
        if !kernel.is_available() {
            return Err(Error::Msg(format!(
                "qgemm: this CPU cannot run {}",
                kernel.name()
            )));
        }
        let col_sums = w
            .chunks_exact(k.max(1))
            .take(n)
            .map(|r| r.iter().map(|&v| v as i32).sum())
            .collect::<Vec<i32>>();
        let col_sums = if k == 0 { vec![0; n] } else { col_sums };
        Ok(PackedB {
            n,
            k,
            kernel,
            data: w.to_vec(),
            col_sums,
        })
    }

    /// Output columns (the weights' rows).
    pub fn n(&self) -> usize {
        self.n
    }
    /// Reduction length.
    pub fn k(&self) -> usize {
        self.k
    }
    /// The kernel the weights are packed for.
    pub fn kernel(&self) -> QKernel {
        self.kernel
    }
    /// `Σ_k W[j, k]` per output column j.
    pub fn col_sums(&self) -> &[i32] {
        &self.col_sums
    }
    /// Bytes held by the packed weights and their sums.
    pub fn nbytes(&self) -> usize {
        self.data.len() + 4 * self.col_sums.len()
    }
}

/// What happens to the exact integer sums `acc[i, j] = Σ_k A[i, k] · W[j, k]`.
///
/// With `c = acc[i, j] - a_zero[i] · colsum[j]` (i32, exact), every kernel computes, in this
/// order and without fused multiply-adds (so all kernels give the same bits):
/// `y = (c as f32) * (a_scale[i] * w_scale[j])`, then `y = y + bias[j]`, then
/// `y = max(y, 0)` with `relu`.
pub enum Epilogue<'a> {
    /// The raw sums, row-major `[m, n]`, no zero-point correction.
    I32 {
        /// `m · n` outputs.
        out: &'a mut [i32],
    },
    /// Dequantised F32 outputs, row-major `[m, n]`.
    F32 {
        /// Per row of A (length m).
        a_scale: &'a [f32],
        /// Per row of A (length m), in 0..=255.
        a_zero: &'a [i32],
        /// Per output column (length n).
        w_scale: &'a [f32],
        /// Per output column (length n).
        bias: Option<&'a [f32]>,
        /// Apply ReLU.
        relu: bool,
        /// `m · n` outputs.
        out: &'a mut [f32],
    },
    /// Requantised u8 outputs, row-major `[m, n]`: `y` as for `F32`, then
    /// `q = clamp(round_ties_even(y * (1 / out_scale)) + out_zero, 0, 255)` (with `relu`,
    /// `y` was clamped at 0 first, so `q ≥ out_zero`).
    U8 {
        /// Per row of A (length m).
        a_scale: &'a [f32],
        /// Per row of A (length m), in 0..=255.
        a_zero: &'a [i32],
        /// Per output column (length n).
        w_scale: &'a [f32],
        /// Per output column (length n).
        bias: Option<&'a [f32]>,
        /// Apply ReLU.
        relu: bool,
        /// Scale of the output.
        out_scale: f32,
        /// Zero point of the output, in 0..=255.
        out_zero: i32,
        /// `m · n` outputs.
        out: &'a mut [u8],
    },
}

impl Epilogue<'_> {
    fn check(&self, m: usize, n: usize) -> Result<()> {
        let bad = |what: &str| Err(Error::shape("qgemm epilogue", what.to_string()));
        match self {
            Epilogue::I32 { out } => {
                if out.len() != m * n {
                    return bad("out length != m·n");
                }
            }
            Epilogue::F32 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                out,
                ..
            } => {
                if out.len() != m * n
                    || a_scale.len() != m
                    || a_zero.len() != m
                    || w_scale.len() != n
                    || bias.is_some_and(|b| b.len() != n)
                {
                    return bad("F32 epilogue lengths");
                }
            }
            Epilogue::U8 {
                a_scale,
                a_zero,
                w_scale,
                bias,
                out,
                ..
            } => {
                if out.len() != m * n
                    || a_scale.len() != m
                    || a_zero.len() != m
                    || w_scale.len() != n
                    || bias.is_some_and(|b| b.len() != n)
                {
                    return bad("U8 epilogue lengths");
                }
            }
        }
        Ok(())
    }
}

/// The F32 value of the epilogue for one element (the definition every kernel follows).
#[inline(always)]
pub fn dequant_one(
    acc: i32,
    a_zero: i32,
    col_sum: i32,
    a_scale: f32,
    w_scale: f32,
    bias: f32,
    relu: bool,
) -> f32 {
    let c = acc.wrapping_sub(a_zero.wrapping_mul(col_sum));
    let y = (c as f32) * (a_scale * w_scale) + bias;
    if relu {
        y.max(0.0)
    } else {
        y
    }
}

/// The u8 value of the requantising epilogue for one F32 value `y`.
#[inline(always)]
pub fn requant_one(y: f32, inv_out_scale: f32, out_zero: i32) -> u8 {
    let q = (y * inv_out_scale).round_ties_even() + out_zero as f32;
    q.clamp(0.0, 255.0) as u8
}

/// `C = A · Wᵀ` through `epi`: `a` holds m rows of k u8 at stride `lda ≥ k`.
pub fn qgemm(a: &[u8], m: usize, lda: usize, b: &PackedB, epi: Epilogue<'_>) -> Result<()> {
    let (n, k) = (b.n, b.k);
    if lda < k || (m > 0 && a.len() < (m - 1) * lda + k) {
        return Err(Error::shape(
            "qgemm",
            format!("A of {} bytes for {m} rows of {k} at stride {lda}", a.len()),
        ));
    }
    epi.check(m, n)?;
    match b.kernel {
        QKernel::Portable => portable(a, m, lda, b, epi),
    }
    Ok(())
}

fn portable(a: &[u8], m: usize, lda: usize, b: &PackedB, mut epi: Epilogue<'_>) {
    let (n, k) = (b.n, b.k);
    for i in 0..m {
        let row = &a[i * lda..i * lda + k];
        for j in 0..n {
            let w = &b.data[j * k..(j + 1) * k];
            let acc: i32 = row.iter().zip(w).map(|(&x, &y)| x as i32 * y as i32).sum();
            store(&mut epi, i, j, n, acc, b.col_sums[j]);
        }
    }
}

#[inline(always)]
fn store(epi: &mut Epilogue<'_>, i: usize, j: usize, n: usize, acc: i32, col_sum: i32) {
    match epi {
        Epilogue::I32 { out } => out[i * n + j] = acc,
        Epilogue::F32 {
            a_scale,
            a_zero,
            w_scale,
            bias,
            relu,
            out,
        } => {
            out[i * n + j] = dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *relu,
            )
        }
        Epilogue::U8 {
            a_scale,
            a_zero,
            w_scale,
            bias,
            relu,
            out_scale,
            out_zero,
            out,
        } => {
            let y = dequant_one(
                acc,
                a_zero[i],
                col_sum,
                a_scale[i],
                w_scale[j],
                bias.map_or(0.0, |b| b[j]),
                *relu,
            );
            out[i * n + j] = requant_one(y, 1.0 / *out_scale, *out_zero);
        }
    }
}
