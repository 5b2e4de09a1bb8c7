//! CUDA C source for hemi's kernels, generated per storage dtype and compiled at run time by
//! NVRTC (one module per dtype).
//!
//! Storage is `__half`, `__nv_bfloat16` or `float`; every kernel loads to `float`, computes
//! and accumulates in F32, and rounds back once with round-to-nearest-even
//! (`__float2half_rn`, `__float2bfloat16_rn`). Entry points are `extern "C"` (unmangled) and
//! named `<kind>_<op>_<dtype>` as [`Kernel::name`] says; the launcher looks them up by that
//! name. Elementwise kernels take an [`IndexParams`] by value (rank <= 8, shape and per-operand
//! strides, broadcasting by zero strides) and write a contiguous output.

use std::fmt::Write as _;

use super::launch::RowStrategy;
pub use crate::backend::map::{BinaryOp, UnaryOp};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Largest rank the elementwise kernels index (after merging dims, see [`IndexParams`]).
pub const MAX_RANK: usize = 8;

/// The storage dtypes with kernels.
pub const DTYPES: [DType; 3] = [DType::F16, DType::BF16, DType::F32];

/// The kernel-name suffix of a dtype, and its CUDA storage type.
pub fn cuda_type(dtype: DType) -> Result<(&'static str, &'static str)> {
    match dtype {
        DType::F16 => Ok(("f16", "__half")),
        DType::BF16 => Ok(("bf16", "__nv_bfloat16")),
        DType::F32 => Ok(("f32", "float")),
        d => Err(Error::dtype(
            "cuda kernels",
            d,
            "CUDA kernels are generated for F16, BF16 and F32 storage",
        )),
    }
}

/// Row reductions (over the last, contiguous dim), F32 accumulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum of the row (F32 accumulation).
    Sum,
    /// The largest value of the row (-inf for an empty row).
    Max,
}

impl ReduceOp {
    /// The op's name, the infix of its kernel's entry points (`sum_rows_warp_f16`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
        }
    }
}

/// One entry point of a dtype's module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `(const T* x, T* y, IndexParams p, float c0, float c1)`: the unary map of this name
    /// (`UnaryOp::name`; one kernel per variant, its scalars `c0`, `c1` passed at launch).
    Unary(&'static str),
    /// `(const T* a, const T* b, T* y, IndexParams p)`
    Binary(BinaryOp),
    /// `(const T* x, U* y, unsigned long long n)`, contiguous; in the module of T.
    Cast(DType),
    /// `(const T* x, T* y, unsigned long long rows, unsigned long long cols)`
    Reduce(ReduceOp, RowStrategy),
    /// `(const T* x, T* y, unsigned long long rows, unsigned long long cols)`
    Softmax(RowStrategy),
    /// `(const unsigned long long* table, unsigned int ntensors, const float* inv_scale,
    /// float* found_inf)`: `table` holds the ntensors grad pointers then their element counts.
    Unscale,
}

impl Kernel {
    /// The entry-point name for storage dtype `dtype`.
    pub fn name(self, dtype: DType) -> Result<String> {
        let (dt, _) = cuda_type(dtype)?;
        Ok(match self {
            Kernel::Unary(name) => format!("unary_{name}_{dt}"),
            Kernel::Binary(op) => format!("binary_{}_{dt}", op.name()),
            Kernel::Cast(to) => {
                if to == dtype {
                    return Err(Error::dtype(
                        "cuda cast",
                        to,
                        "a cast to the same dtype is a copy",
                    ));
                }
                format!("cast_{dt}_to_{}", cuda_type(to)?.0)
            }
            Kernel::Reduce(op, s) => format!("{}_rows_{}_{dt}", op.name(), s.name()),
            Kernel::Softmax(s) => format!("softmax_rows_{}_{dt}", s.name()),
            Kernel::Unscale => format!("unscale_{dt}"),
        })
    }

    /// Every entry point of a dtype's module.
    pub fn all(dtype: DType) -> Vec<Kernel> {
        let strategies = [RowStrategy::WarpPerRow, RowStrategy::BlockPerRow];
        let mut k: Vec<Kernel> = UnaryOp::ALL
            .iter()
            .map(|o| Kernel::Unary(o.name()))
            .collect();
        k.extend(BinaryOp::ALL.iter().map(|&o| Kernel::Binary(o)));
        k.extend(
            DTYPES
                .iter()
                .filter(|&&d| d != dtype)
                .map(|&d| Kernel::Cast(d)),
        );
        for s in strategies {
            k.push(Kernel::Reduce(ReduceOp::Sum, s));
            k.push(Kernel::Reduce(ReduceOp::Max, s));
            k.push(Kernel::Softmax(s));
        }
        k.push(Kernel::Unscale);
        k
    }
}

/// The index arguments of the elementwise kernels, passed by value (`struct HemiIndex` in the
/// source; same field order, all 64-bit so there is no padding). Output index `i` (row-major
/// over `shape`) reads operand a at `sum(coord[d] * stride_a[d])`, b likewise; a zero stride
/// broadcasts. See [`IndexParams::offsets`], which is the kernel's loop in Rust.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexParams {
    /// Number of dims used (at most `MAX_RANK`).
    pub rank: i64,
    /// Number of output elements (the product of `shape[..rank]`).
    pub numel: i64,
    /// The output's shape; entries past `rank` are unused.
    pub shape: [i64; MAX_RANK],
    /// Operand a's element strides per output dim (0: broadcast).
    pub stride_a: [i64; MAX_RANK],
    /// Operand b's element strides per output dim (0: broadcast).
    pub stride_b: [i64; MAX_RANK],
}

impl IndexParams {
    /// For a unary map of a strided view.
    pub fn unary(shape: &[usize], strides: &[isize]) -> Result<Self> {
        if shape.len() != strides.len() {
            return Err(Error::shape(
                "cuda index",
                format!("shape {shape:?} with strides {strides:?}"),
            ));
        }
        Self::build(shape, strides, strides)
    }

    /// For a binary map: broadcasts the shapes (numpy rules, right-aligned); the output shape
    /// and the parameters.
    pub fn binary(
        a_shape: &[usize],
        a_strides: &[isize],
        b_shape: &[usize],
        b_strides: &[isize],
    ) -> Result<(Vec<usize>, Self)> {
        if a_shape.len() != a_strides.len() || b_shape.len() != b_strides.len() {
            return Err(Error::shape(
                "cuda index",
                format!("shape/stride ranks differ: {a_shape:?}/{a_strides:?}, {b_shape:?}/{b_strides:?}"),
            ));
        }
        let rank = a_shape.len().max(b_shape.len());
        let mut out = vec![0usize; rank];
        let mut sa = vec![0isize; rank];
        let mut sb = vec![0isize; rank];
        for d in 0..rank {
            let get = |s: &[usize], st: &[isize]| {
                let off = rank - s.len();
                if d < off {
                    (1, 0)
                } else {
                    (s[d - off], st[d - off])
                }
            };
            let (na, xa) = get(a_shape, a_strides);
            let (nb, xb) = get(b_shape, b_strides);
            out[d] = match (na, nb) {
                _ if na == nb => na,
                (1, n) | (n, 1) => n,
                _ => {
                    return Err(Error::shape(
                        "cuda binary",
                        format!("cannot broadcast {a_shape:?} with {b_shape:?}"),
                    ))
                }
            };
            sa[d] = if na == 1 { 0 } else { xa };
            sb[d] = if nb == 1 { 0 } else { xb };
        }
        let p = Self::build(&out, &sa, &sb)?;
        Ok((out, p))
    }

    /// Drops size-1 dims, merges dims that are contiguous with each other in both operands,
    /// and checks the rank that is left fits.
    fn build(shape: &[usize], sa: &[isize], sb: &[isize]) -> Result<Self> {
        if sa.iter().chain(sb).any(|&s| s < 0) {
            return Err(Error::arg(
                "cuda index",
                format!("negative strides {sa:?} / {sb:?} are not supported (make a contiguous copy first)"),
            ));
        }
        let mut numel: u64 = 1;
        for &n in shape {
            numel = numel
                .checked_mul(n as u64)
                .filter(|&v| v <= i64::MAX as u64)
                .ok_or_else(|| {
                    Error::shape(
                        "cuda index",
                        format!("{shape:?} has more than 2^63 elements"),
                    )
                })?;
        }
        // (size, stride a, stride b), outermost first.
        let mut dims: Vec<(i64, i64, i64)> = Vec::new();
        for d in 0..shape.len() {
            if shape[d] == 1 {
                continue;
            }
            let cur = (shape[d] as i64, sa[d] as i64, sb[d] as i64);
            if let Some(last) = dims.last_mut() {
                if numel > 0 && last.1 == cur.1 * cur.0 && last.2 == cur.2 * cur.0 {
                    *last = (last.0 * cur.0, cur.1, cur.2);
                    continue;
                }
            }
            dims.push(cur);
        }
        if numel == 0 {
            dims.clear();
        }
        if dims.len() > MAX_RANK {
            return Err(Error::shape(
                "cuda index",
                format!(
                    "{shape:?} with strides {sa:?} / {sb:?} needs rank {} after merging dims; \
                     the CUDA kernels index at most {MAX_RANK} (make a contiguous copy first)",
                    dims.len()
                ),
            ));
        }
        for st in [sa, sb] {
            let mut top: u64 = 0;
            for (d, &n) in shape.iter().enumerate() {
                if n > 0 {
                    top = (n as u64 - 1)
                        .checked_mul(st[d] as u64)
                        .and_then(|v| v.checked_add(top))
                        .filter(|&v| v <= i64::MAX as u64)
                        .ok_or_else(|| {
                            Error::arg(
                                "cuda index",
                                format!("strides {st:?} overflow over {shape:?}"),
                            )
                        })?;
                }
            }
        }
        let mut p = IndexParams {
            rank: dims.len() as i64,
            numel: numel as i64,
            shape: [1; MAX_RANK],
            stride_a: [0; MAX_RANK],
            stride_b: [0; MAX_RANK],
        };
        for (d, &(n, a, b)) in dims.iter().enumerate() {
            p.shape[d] = n;
            p.stride_a[d] = a;
            p.stride_b[d] = b;
        }
        Ok(p)
    }

    /// The largest offset each operand reads (`(0, 0)` when empty): must be inside its storage.
    pub fn max_offsets(&self) -> (i64, i64) {
        if self.numel == 0 {
            return (0, 0);
        }
        (0..self.rank as usize).fold((0, 0), |(a, b), d| {
            let n = self.shape[d] - 1;
            (a + n * self.stride_a[d], b + n * self.stride_b[d])
        })
    }

    /// The operand offsets of output element `i`: exactly the kernel's `hemi_offsets`.
    pub fn offsets(&self, mut i: u64) -> (i64, i64) {
        let (mut a, mut b) = (0i64, 0i64);
        for d in (0..self.rank as usize).rev() {
            let s = self.shape[d] as u64;
            let c = (i % s) as i64;
            i /= s;
            a += c * self.stride_a[d];
            b += c * self.stride_b[d];
        }
        (a, b)
    }
}

/// Shared by every module: headers, conversions, the index helper, warp/block reductions.
#[doc(hidden)]
pub fn prelude() -> &'static str {
    r#"#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define HEMI_MAX_RANK 8
#define HEMI_FLT_MAX 3.40282346638528859812e+38f
#define HEMI_GRID_STRIDE(i, n) for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

struct HemiIndex {
    long long rank;
    long long numel;
    long long shape[HEMI_MAX_RANK];
    long long stride_a[HEMI_MAX_RANK];
    long long stride_b[HEMI_MAX_RANK];
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ bool hemi_finite(float v) { return fabsf(v) <= HEMI_FLT_MAX; }
__device__ __forceinline__ float hemi_neg_inf() { return __int_as_float(0xff800000); }
/* NaN-propagating max/min, as torch.maximum/minimum. */
__device__ __forceinline__ float hemi_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float hemi_min(float a, float b) { return (a != a || a < b) ? a : b; }

__device__ __forceinline__ void hemi_offsets(const HemiIndex& p, unsigned long long i, long long* oa, long long* ob) {
    long long a = 0, b = 0;
    for (int d = (int)p.rank - 1; d >= 0; --d) {
        const unsigned long long s = (unsigned long long)p.shape[d];
        const long long c = (long long)(i % s);
        i /= s;
        a += c * p.stride_a[d];
        b += c * p.stride_b[d];
    }
    *oa = a;
    *ob = b;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = hemi_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* Every thread of the block gets the result. The leading barrier lets a loop call it again. */
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, nw = (blockDim.x + 31u) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? part[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    return part[0];
}
__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
    const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5, nw = (blockDim.x + 31u) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? part[lane] : hemi_neg_inf();
        v = warp_max(v);
        if (lane == 0) part[0] = v;
    }
    __syncthreads();
    return part[0];
}
"#
}

/// The row-loop heads of the two strategies: which rows a warp/block takes, and the column
/// loop start/step of a thread within it.
fn row_loop(s: RowStrategy) -> (&'static str, &'static str, &'static str) {
    match s {
        RowStrategy::WarpPerRow => (
            "const unsigned lane = threadIdx.x & 31u;\n    \
             const unsigned long long first = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;\n    \
             const unsigned long long step = ((unsigned long long)gridDim.x * blockDim.x) >> 5;\n    \
             for (unsigned long long r = first; r < rows; r += step)",
            "lane",
            "32",
        ),
        RowStrategy::BlockPerRow => (
            "for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x)",
            "threadIdx.x",
            "blockDim.x",
        ),
    }
}

/// The full source of the module for storage dtype `dtype`.
pub fn module_source(dtype: DType) -> Result<String> {
    let (_, ty) = cuda_type(dtype)?;
    let mut s = String::from(prelude());
    let w = &mut s;
    let name = |k: Kernel| k.name(dtype);
    for op in UnaryOp::ALL {
        let _ = write!(
            w,
            "\nextern \"C\" __global__ void {n}(const {ty}* __restrict__ xs, {ty}* __restrict__ ys, HemiIndex p, float c0, float c1) {{\n    \
             HEMI_GRID_STRIDE(i, (unsigned long long)p.numel) {{\n        \
             long long oa, ob;\n        hemi_offsets(p, i, &oa, &ob);\n        \
             const float x = to_f32(xs[oa]);\n        ys[i] = from_f32<{ty}>({e});\n    }}\n}}\n",
            n = name(Kernel::Unary(op.name()))?,
            e = op.cuda(),
        );
    }
    for op in BinaryOp::ALL {
        let _ = write!(
            w,
            "\nextern \"C\" __global__ void {n}(const {ty}* __restrict__ as, const {ty}* __restrict__ bs, {ty}* __restrict__ ys, HemiIndex p) {{\n    \
             HEMI_GRID_STRIDE(i, (unsigned long long)p.numel) {{\n        \
             long long oa, ob;\n        hemi_offsets(p, i, &oa, &ob);\n        \
             const float a = to_f32(as[oa]), b = to_f32(bs[ob]);\n        ys[i] = from_f32<{ty}>({e});\n    }}\n}}\n",
            n = name(Kernel::Binary(op))?,
            e = op.cuda(),
        );
    }
    for to in DTYPES.into_iter().filter(|&d| d != dtype) {
        let (_, tty) = cuda_type(to)?;
        // Through F32: exact for F16/BF16 -> F32, one RNE rounding otherwise.
        let _ = write!(
            w,
            "\nextern \"C\" __global__ void {n}(const {ty}* __restrict__ xs, {tty}* __restrict__ ys, unsigned long long n) {{\n    \
             HEMI_GRID_STRIDE(i, n) {{ ys[i] = from_f32<{tty}>(to_f32(xs[i])); }}\n}}\n",
            n = name(Kernel::Cast(to))?,
        );
    }
    for strategy in [RowStrategy::WarpPerRow, RowStrategy::BlockPerRow] {
        let (head, c0, cstep) = row_loop(strategy);
        let (wsum, wmax) = match strategy {
            RowStrategy::WarpPerRow => ("warp_sum", "warp_max"),
            RowStrategy::BlockPerRow => ("block_sum", "block_max"),
        };
        let leader = match strategy {
            RowStrategy::WarpPerRow => "lane == 0",
            RowStrategy::BlockPerRow => "threadIdx.x == 0",
        };
        for (op, init, acc, red) in [
            (ReduceOp::Sum, "0.0f", "acc += v", wsum),
            (
                ReduceOp::Max,
                "hemi_neg_inf()",
                "acc = hemi_max(acc, v)",
                wmax,
            ),
        ] {
            let _ = write!(
                w,
                "\nextern \"C\" __global__ void {n}(const {ty}* __restrict__ xs, {ty}* __restrict__ ys, unsigned long long rows, unsigned long long cols) {{\n    \
                 {head} {{\n        const {ty}* x = xs + r * cols;\n        float acc = {init};\n        \
                 for (unsigned long long c = {c0}; c < cols; c += {cstep}) {{ const float v = to_f32(x[c]); {acc}; }}\n        \
                 acc = {red}(acc);\n        if ({leader}) ys[r] = from_f32<{ty}>(acc);\n    }}\n}}\n",
                n = name(Kernel::Reduce(op, strategy))?,
            );
        }
        let _ = write!(
            w,
            "\nextern \"C\" __global__ void {n}(const {ty}* __restrict__ xs, {ty}* __restrict__ ys, unsigned long long rows, unsigned long long cols) {{\n    \
             {head} {{\n        const {ty}* x = xs + r * cols;\n        {ty}* y = ys + r * cols;\n        \
             float m = hemi_neg_inf();\n        \
             for (unsigned long long c = {c0}; c < cols; c += {cstep}) m = hemi_max(m, to_f32(x[c]));\n        \
             m = {wmax}(m);\n        float s = 0.0f;\n        \
             for (unsigned long long c = {c0}; c < cols; c += {cstep}) s += expf(to_f32(x[c]) - m);\n        \
             const float inv = 1.0f / {wsum}(s);\n        \
             for (unsigned long long c = {c0}; c < cols; c += {cstep}) y[c] = from_f32<{ty}>(expf(to_f32(x[c]) - m) * inv);\n    }}\n}}\n",
            n = name(Kernel::Softmax(strategy))?,
        );
    }
    // GradScaler: unscale every grad in place (F32 multiply, one rounding) and raise the
    // found-inf flag if any unscaled value is not finite. blockIdx.y walks the tensors.
    let _ = write!(
        w,
        "\nextern \"C\" __global__ void {n}(const unsigned long long* __restrict__ table, unsigned int ntensors, const float* __restrict__ inv_scale, float* found_inf) {{\n    \
         const float inv = *inv_scale;\n    \
         for (unsigned int t = blockIdx.y; t < ntensors; t += gridDim.y) {{\n        \
         {ty}* g = ({ty}*)table[t];\n        const unsigned long long n = table[ntensors + t];\n        bool bad = false;\n        \
         HEMI_GRID_STRIDE(i, n) {{\n            const float v = to_f32(g[i]) * inv;\n            \
         if (!hemi_finite(v)) bad = true;\n            g[i] = from_f32<{ty}>(v);\n        }}\n        \
         if (bad) *found_inf = 1.0f;\n    }}\n}}\n",
        n = name(Kernel::Unscale)?,
    );
    Ok(s)
}

/// 64-bit FNV-1a: a stable hash (the same across runs and builds) for cache keys.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The key a compiled module is cached under: dtype, target architecture, and a hash of the
/// exact source and options, so a changed kernel or flag never reuses a stale module. Also a
/// valid NVRTC program name.
pub fn module_key(dtype: DType, arch: &str, source: &str, options: &[String]) -> Result<String> {
    let (dt, _) = cuda_type(dtype)?;
    let mut bytes = source.as_bytes().to_vec();
    for o in options {
        bytes.push(0);
        bytes.extend_from_slice(o.as_bytes());
    }
    let arch: String = arch
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Ok(format!("hemi_{dt}_{arch}_{:016x}", fnv1a(&bytes)))
}
