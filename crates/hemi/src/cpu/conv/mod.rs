//! 2-D convolutions over plain buffers: which route each convolution takes (its plan), and
//! the im2col + GEMM forward and backward (input, weight) of a grouped, strided, padded,
//! dilated convolution, parallel over the batch. No autograd and no validation here:
//! `ops/conv.rs` checks the shapes and `cpu::ops::nn` hands over contiguous buffers:
//! elements `T` (any float dtype) unfolded as stored, products and sums in the compute type
//! `C` (`cpu::gemm::product` picks the GEMM: the `gemm` crate when `T` is `C`, hemi's
//! blocked GEMM for F16/BF16 with F32 accumulation).
//!
//! Layout: input `[n, c_in, h, w]`, weight `[c_out, c_in/groups, kh, kw]`, output
//! `[n, c_out, h_out, w_out]`, all row-major contiguous. Per image, the column matrix is
//! `[c_in*kh*kw, h_out*w_out]`; group `g` owns rows `g*K..(g+1)*K` (K = c_in/groups*kh*kw),
//! so each group's product is one GEMM on contiguous row blocks:
//! `y_g [c_out/groups, L] = w_g [c_out/groups, K] x col_g [K, L]`.
//!
//! The input gradient of a stride-1 convolution runs as the forward convolution of `dy`
//! with the flipped kernels (`transposed_input_conv`); other strides as `w^T x dy` and
//! col2im.
//!
//! The routes other than im2col + GEMM, each chosen here where it applies: `direct` (few
//! output channels, read straight from the image), `implicit` (an implicit GEMM from a
//! padded copy), `wgrad` (weight gradients as dot products from the image), `amx` (BF16 on
//! AMX tiles read from the image, with its cache-line-aligned buffers in `aligned`); and
//! `block`, the fused convolution + ReLU + 2×2 max-pool of small CNNs. `im2col` builds the
//! column matrix, `reference` holds the F64 definitions the tests compare against.

pub(crate) mod aligned;
pub mod amx;
pub mod block;
pub mod direct;
pub mod im2col;
pub mod implicit;
pub mod reference;
pub mod wgrad;

pub use crate::backend::nn::{conv_out_size, Conv2dGeom};
use crate::cpu::chunked::{self, blocks_uninit, blocks_zeroed, per_block_with};
use crate::cpu::conv::amx::{AmxConvPlan, AmxInputGradPlan, AmxWgradPlan};
use crate::cpu::conv::direct::DirectPlan;
use crate::cpu::conv::implicit::ImplicitPlan;
use crate::cpu::conv::wgrad::WgradPlan;
use crate::cpu::gemm::blocked::{
    gemm_packed, gemm_unfold, gemm_unfold_packed, gemm_unfold_pairs_packed,
};
use crate::cpu::gemm::pack::PackedA;
use crate::cpu::gemm::select::{f32_kernel, kernel_for, Kernel};
use crate::cpu::gemm::unfold::Unfold;
use crate::cpu::gemm::{product, unfold_kernel, MatRef};
use crate::cpu::reduce::sum_slice;
use crate::cpu::runs::Runs;
use crate::dtype::{same_slice, FloatDType, WithDType};
use crate::tensor::CpuStorage;
use crate::DType;
use half::{bf16, f16};
use im2col::{col2im, im2col};
use std::mem::MaybeUninit;

/// The column matrix of one image: the image itself for pointwise convolutions, else
/// `im2col` into `scratch`.
fn columns<'a, T: Copy + Default>(x: &'a [T], scratch: &'a mut Vec<T>, g: &Conv2dGeom) -> &'a [T] {
    if g.is_pointwise() {
        return x;
    }
    scratch.resize(g.col_len(), T::default());
    im2col(x, scratch, g);
    scratch
}

/// Row `r` of `dst` (rows of `l` values) set to `bias[r]`: a convolution's output before the
/// product accumulates into it.
fn fill_rows<C: Copy>(dst: &mut [C], l: usize, bias: &[C]) {
    for (row, &b) in dst.chunks_exact_mut(l).zip(bias) {
        row.fill(b);
    }
}

/// The weights of a convolution, one matrix `[c_out/groups, K]` per group, packed once for
/// the kernel of hemi's GEMM that every image's product runs on (`gemm::pack::PackedA`)
/// instead of once per image: for ResNet-20's 64-channel layers (64×576 weights, 8×8
/// images) packing them was a tenth of the convolution. `None` where the products run on
/// the `gemm` crate (F64, and F32 shapes `f32_kernel` leaves to it). The kernel is the one
/// `product` and `image_forward`'s unfold would pick, so the bits are the same.
fn packed_weights<T: WithDType, C: FloatDType>(w: &[T], g: &Conv2dGeom) -> Option<Vec<PackedA>> {
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    if C::DTYPE != DType::F32 || m == 0 || k == 0 || l == 0 {
        return None;
    }
    let kernel = match T::DTYPE {
        DType::F32 => f32_kernel(m, k, l)?,
        DType::F16 | DType::BF16 => kernel_for(T::DTYPE, T::DTYPE, m, k, l),
        _ => return None,
    };
    let groups = (0..g.groups).map(|grp| {
        PackedA::new(
            kernel,
            MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k),
        )
    });
    Some(groups.collect())
}

/// `w^T` of each group packed once for the half-precision input gradient's per-image
/// products `w_g^T · dy_g` (pointwise and strided convolutions), with the kernel `product`
/// would pick, so the same bits; before, each image packed it again (`pack_amx_a` was 4 % of
/// a ResNet-50 amp-bf16 step on AMX). `None` for other dtypes and empty products.
fn transposed_packed<T: WithDType>(w: &[T], g: &Conv2dGeom) -> Option<Vec<PackedA>> {
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    if !matches!(T::DTYPE, DType::F16 | DType::BF16) || m == 0 || k == 0 || l == 0 {
        return None;
    }
    let kernel = kernel_for(T::DTYPE, T::DTYPE, k, m, l);
    let groups = (0..g.groups).map(|grp| {
        let wg = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k);
        PackedA::new(kernel, wg.t())
    });
    Some(groups.collect())
}

/// The plan of a forward convolution read straight from the image (`cpu::conv::direct`), for
/// F32 or BF16 tensors with F32 results, where that route applies (few output channels,
/// stride 1, 'same' width, AVX-512).
fn direct_plan<T: WithDType, C: FloatDType>(w: &[T], g: &Conv2dGeom) -> Option<DirectPlan> {
    if C::DTYPE != DType::F32 {
        return None;
    }
    // Half planes only where their products are widened to F32 anyway (not BF16 on a pair
    // kernel).
    let widened = || kernel_for(T::DTYPE, T::DTYPE, g.c_out_g(), g.k(), g.l()).packs_f32();
    if let Some(w) = same_slice::<T, f32>(w) {
        DirectPlan::new(g, w)
    } else if let Some(w) = same_slice::<T, bf16>(w) {
        widened().then(|| DirectPlan::new(g, w)).flatten()
    } else if let Some(w) = same_slice::<T, f16>(w) {
        widened().then(|| DirectPlan::new(g, w)).flatten()
    } else {
        None
    }
}

/// The plan of a forward convolution as an implicit GEMM from a padded copy of the image
/// (`cpu::conv::implicit`), for F32, F16 or BF16 tensors with F32 results, where that route
/// applies (output channels a multiple of 32, not pointwise, ungrouped, AVX-512) and the
/// half products would be widened to F32 anyway (not BF16 on a pair kernel).
fn implicit_plan<T: WithDType, C: FloatDType>(w: &[T], g: &Conv2dGeom) -> Option<ImplicitPlan> {
    if C::DTYPE != DType::F32 {
        return None;
    }
    let widened = || kernel_for(T::DTYPE, T::DTYPE, g.c_out_g(), g.k(), g.l()).packs_f32();
    if let Some(w) = same_slice::<T, f32>(w) {
        ImplicitPlan::new(g, w)
    } else if let Some(w) = same_slice::<T, bf16>(w) {
        widened().then(|| ImplicitPlan::new(g, w)).flatten()
    } else if let Some(w) = same_slice::<T, f16>(w) {
        widened().then(|| ImplicitPlan::new(g, w)).flatten()
    } else {
        None
    }
}

/// The weight-gradient plan of an implicit GEMM (`cpu::conv::implicit`) for F32, F16 or BF16
/// tensors, where `implicit_plan` would take the forward.
fn implicit_wgrad_plan<T: WithDType>(g: &Conv2dGeom) -> Option<ImplicitPlan> {
    let widened = || kernel_for(T::DTYPE, T::DTYPE, g.c_out_g(), g.l(), g.k()).packs_f32();
    match T::DTYPE {
        DType::F32 => ImplicitPlan::weight_grad(g),
        DType::F16 | DType::BF16 => widened().then(|| ImplicitPlan::weight_grad(g)).flatten(),
        _ => None,
    }
}

/// `plan.add_weight_grad` on F32, F16 or BF16 tensors.
fn implicit_wgrad<T: WithDType>(plan: &ImplicitPlan, x: &[T], dy: &[T], n: usize, dw: &mut [f32]) {
    if let (Some(x), Some(dy)) = (same_slice::<T, f32>(x), same_slice::<T, f32>(dy)) {
        plan.add_weight_grad(x, dy, n, dw)
    } else if let (Some(x), Some(dy)) = (same_slice::<T, bf16>(x), same_slice::<T, bf16>(dy)) {
        plan.add_weight_grad(x, dy, n, dw)
    } else if let (Some(x), Some(dy)) = (same_slice::<T, f16>(x), same_slice::<T, f16>(dy)) {
        plan.add_weight_grad(x, dy, n, dw)
    } else {
        unreachable!("implicit_wgrad_plan: F32, F16 or BF16")
    }
}

/// A convolution's weights prepared once for all its images: read from the image
/// (`direct`), or as an implicit GEMM (`implicit`), or else packed for the GEMM (`packed`),
/// or none of these.
struct Prepared {
    direct: Option<DirectPlan>,
    implicit: Option<ImplicitPlan>,
    amx: Option<AmxConvPlan>,
    packed: Option<Vec<PackedA>>,
}

impl Prepared {
    fn new<T: WithDType, C: FloatDType>(w: &[T], g: &Conv2dGeom) -> Self {
        let direct = direct_plan::<T, C>(w, g);
        let implicit = match direct {
            Some(_) => None,
            None => implicit_plan::<T, C>(w, g),
        };
        let amx = match (&direct, &implicit) {
            (None, None) => amx_plan::<T, C>(w, g),
            _ => None,
        };
        let packed = match (&direct, &implicit, &amx) {
            (None, None, None) => packed_weights::<T, C>(w, g),
            _ => None,
        };
        Prepared {
            direct,
            implicit,
            amx,
            packed,
        }
    }
}

/// The plan of a BF16 weight gradient on AMX tiles (`cpu::conv::amx`), where hemi's GEMM
/// would run its product on `amx-bf16`.
fn amx_wgrad_plan(g: &Conv2dGeom) -> Option<AmxWgradPlan> {
    amx_gemm(g.c_out_g(), g.l(), g.k())
        .then(|| AmxWgradPlan::new(g))
        .flatten()
}

/// The plan of a BF16 forward convolution on AMX tiles read from the image
/// (`cpu::conv::amx`), where hemi's GEMM would run it on `amx-bf16` (so `force_kernel`
/// keeps its say) and the convolution suits it.
fn amx_plan<T: WithDType, C: FloatDType>(w: &[T], g: &Conv2dGeom) -> Option<AmxConvPlan> {
    if C::DTYPE != DType::F32 || !amx_gemm(g.c_out_g(), g.k(), g.l()) {
        return None;
    }
    AmxConvPlan::new(g, same_slice::<T, bf16>(w)?)
}

/// Whether hemi's GEMM would run a BF16 `m×k · k×n` product on `amx-bf16`.
fn amx_gemm(m: usize, k: usize, n: usize) -> bool {
    kernel_for(DType::BF16, DType::BF16, m, k, n) == Kernel::AmxBf16
}

/// Forward of one image: `y [c_out, L] = w x col (+ bias)` (an AMX plan in `prep` is run by
/// `conv2d_forward_blocks` instead, whole images into BF16): from the image where `prep` has
/// a direct plan, else group by group on the GEMM, with the weights packed beforehand where
/// `prep` holds them.
#[allow(clippy::too_many_arguments)]
fn image_forward<T: WithDType, C: FloatDType>(
    x: &[T],
    w: &[T],
    prep: &Prepared,
    bias: Option<&[C]>,
    y: &mut [C],
    scratch: &mut Vec<T>,
    g: &Conv2dGeom,
    par: bool,
) {
    if let Some(d) = &prep.direct {
        let y = C::as_f32_mut(y).expect("direct_plan: F32 results");
        let bias = bias.map(|b| C::as_f32(b).expect("direct_plan: F32 bias"));
        if let Some(x) = same_slice::<T, f32>(x) {
            return d.image(x, bias, y);
        }
        if let Some(x) = same_slice::<T, bf16>(x) {
            return d.image(x, bias, y);
        }
        if let Some(x) = same_slice::<T, f16>(x) {
            return d.image(x, bias, y);
        }
    }
    if let Some(plan) = &prep.implicit {
        let y = C::as_f32_mut(y).expect("implicit_plan: F32 results");
        let bias = bias.map(|b| C::as_f32(b).expect("implicit_plan: F32 bias"));
        if let Some(x) = same_slice::<T, f32>(x) {
            return plan.image(x, bias, y);
        }
        if let Some(x) = same_slice::<T, bf16>(x) {
            return plan.image(x, bias, y);
        }
        if let Some(x) = same_slice::<T, f16>(x) {
            return plan.image(x, bias, y);
        }
    }
    let packed = prep.packed.as_deref();
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    // Stride-1 'same'-width convolutions on hemi's GEMM read the column matrix straight from
    // the image (`gemm::unfold::Unfold`); the rest unfold it first.
    let unfold = Unfold::conv(x, g, 0).and(unfold_kernel::<C, T>(m, k, l));
    let col = if unfold.is_some() {
        x
    } else {
        columns(x, scratch, g)
    };
    for grp in 0..g.groups {
        let a = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k);
        let dst = &mut y[grp * m * l..(grp + 1) * m * l];
        if let Some(bias) = bias {
            fill_rows(dst, l, &bias[grp * m..(grp + 1) * m]);
        }
        let pa = packed.map(|p| &p[grp]);
        if let (Some(kernel), Some(u)) = (unfold, Unfold::conv(x, g, grp)) {
            let dst = C::as_f32_mut(dst).expect("unfold_kernel: F32 results");
            match pa {
                Some(pa) => gemm_unfold_packed(dst, pa, u, bias.is_some(), par),
                None => gemm_unfold(kernel, dst, a, u, bias.is_some(), par),
            }
            continue;
        }
        let b = MatRef::row_major(&col[grp * k * l..(grp + 1) * k * l], k, l);
        match pa {
            Some(pa) => {
                let dst = C::as_f32_mut(dst).expect("packed_weights: F32 results");
                gemm_packed(dst, pa, b, bias.is_some(), par)
            }
            None => product(dst, a, b, bias.is_some(), par),
        }
    }
}

/// Convolution forward: `x [n, c_in, h, w]`, `w [c_out, c_in/groups, kh, kw]`, optional
/// `bias [c_out]` -> `y [n, c_out, h_out, w_out]`. Parallel over images (each GEMM on its
/// thread); a single image gets a parallel GEMM instead.
pub fn conv2d_forward<C: FloatDType>(
    x: &[C],
    w: &[C],
    bias: Option<&[C]>,
    g: &Conv2dGeom,
) -> Vec<C> {
    if g.n == 0 || g.out_image() == 0 {
        return Vec::new();
    }
    let prep = Prepared::new::<C, C>(w, g);
    let par = g.n == 1;
    blocks_zeroed(g.n, g.out_image(), 1, Vec::new, |scratch, i, yi| {
        let xi = &x[i * g.in_image()..(i + 1) * g.in_image()];
        image_forward(xi, w, &prep, bias, yi, scratch, g, par)
    })
}

/// The input gradient of a stride-1 convolution as a convolution of `dy`: with
/// `w' [c_in, c_out/groups, kh, kw]`, `w'[gi·cig + ci, co, a, b] = w[gi·m + co, ci, kh-1-a,
/// kw-1-b]` (each group's kernels transposed and turned by 180°) and padding
/// `dilation·(k-1) - padding`, `dx = conv(dy, w')` has the input's size. Returns the flipped
/// weight and the geometry of that convolution, or `None` where it does not apply (strides
/// other than 1, padding wider than the dilated kernel, pointwise convolutions, which need
/// no column matrix).
///
/// Why: `w^T · dy` followed by col2im computes the same sums, but its product has only
/// `c_out/groups` as inner dimension (16 for ResNet's first stage), so the GEMM mostly loads
/// and stores its column matrix, and col2im then adds `kh·kw` shifted copies of it into dx.
/// As a convolution the inner dimension is `c_out/groups·kh·kw`, the output is dx itself,
/// and the column matrix is a copy (im2col) rather than a scatter-add.
fn transposed_input_conv<T: Copy>(w: &[T], g: &Conv2dGeom) -> Option<(Vec<T>, Conv2dGeom)> {
    let span = |k: usize, d: usize| (k - 1) * d;
    let (ph, pw) = (span(g.kh, g.dilation.0), span(g.kw, g.dilation.1));
    if g.stride != (1, 1) || g.is_pointwise() || g.padding.0 > ph || g.padding.1 > pw {
        return None;
    }
    if g.out_image() == 0 || g.in_image() == 0 {
        return None;
    }
    let (m, cig, kk) = (g.c_out_g(), g.c_in / g.groups, g.kh * g.kw);
    let mut flipped = Vec::with_capacity(w.len());
    for gi in 0..g.groups {
        for ci in 0..cig {
            for co in 0..m {
                let kernel = &w[((gi * m + co) * cig + ci) * kk..][..kk];
                flipped.extend(kernel.iter().rev());
            }
        }
    }
    let tg = Conv2dGeom {
        n: g.n,
        c_in: g.c_out,
        h: g.h_out,
        w: g.w_out,
        c_out: g.c_in,
        kh: g.kh,
        kw: g.kw,
        stride: (1, 1),
        padding: (ph - g.padding.0, pw - g.padding.1),
        dilation: g.dilation,
        groups: g.groups,
        h_out: g.h,
        w_out: g.w,
    };
    Some((flipped, tg))
}

/// Input gradient of one image: `dcol = w^T x dy` per group, then col2im into `dx`.
fn image_backward_input<T: WithDType, C: FloatDType>(
    dy: &[T],
    w: &[T],
    packed: Option<&[PackedA]>,
    dx: &mut [C],
    scratch: &mut Vec<C>,
    g: &Conv2dGeom,
    par: bool,
) {
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    let pointwise = g.is_pointwise();
    if !pointwise {
        scratch.resize(g.col_len(), C::zero());
    }
    // Pointwise: the column matrix is the image, so the product lands in dx directly.
    let dcol: &mut [C] = if pointwise { dx } else { scratch };
    for grp in 0..g.groups {
        let wt = MatRef::row_major(&w[grp * m * k..(grp + 1) * m * k], m, k).t();
        let b = MatRef::row_major(&dy[grp * m * l..(grp + 1) * m * l], m, l);
        let dst = &mut dcol[grp * k * l..(grp + 1) * k * l];
        match packed {
            Some(p) => {
                let dst = C::as_f32_mut(dst).expect("transposed_packed: F32 results");
                gemm_packed(dst, &p[grp], b, false, par)
            }
            None => product(dst, wt, b, false, par),
        }
    }
    if !pointwise {
        col2im(scratch, dx, g);
    }
}

/// Gradient of the convolution with respect to its input: `dy [n, c_out, h_out, w_out]`,
/// `w` -> `dx [n, c_in, h, w]`. Parallel over images.
pub fn conv2d_backward_input<C: FloatDType>(dy: &[C], w: &[C], g: &Conv2dGeom) -> Vec<C> {
    if let Some((wt, tg)) = transposed_input_conv(w, g) {
        return conv2d_forward(dy, &wt, None, &tg);
    }
    if g.n == 0 || g.in_image() == 0 {
        return Vec::new();
    }
    if g.out_image() == 0 {
        return vec![C::zero(); g.n * g.in_image()];
    }
    let par = g.n == 1;
    blocks_zeroed(g.n, g.in_image(), 1, Vec::new, |scratch, i, dxi| {
        let dyi = &dy[i * g.out_image()..(i + 1) * g.out_image()];
        image_backward_input(dyi, w, None, dxi, scratch, g, par)
    })
}

/// Gradient of the convolution with respect to its weight:
/// `dw_g [c_out/groups, K] = sum_n dy_g[n] [c_out/groups, L] x col_g[n]^T [L, K]`.
///
/// The batch is cut into runs of images fixed by the batch size (`Runs`, not by the thread
/// count); each run sums its images in order into its own buffer, and the buffers are added
/// in run order, so the result is the same on any number of threads. F32 and BF16
/// convolutions that `cpu::conv::wgrad` reads (stride 1, output rows as long as input rows, at
/// most 16 output channels, on an AVX-512 kernel) skip im2col and the GEMM: dot products
/// straight from the image.
/// Elements `T` as stored, the gradient in the compute type `C` (F32 for F16/BF16).
pub fn conv2d_backward_weight<T: WithDType, C: FloatDType>(
    x: &[T],
    dy: &[T],
    g: &Conv2dGeom,
) -> Vec<C> {
    let len = g.weight_len();
    if g.n == 0 || len == 0 || g.l() == 0 {
        return vec![C::zero(); len];
    }
    if C::DTYPE == DType::F32 {
        // BF16 on AMX tiles read from copies of the images (`cpu::conv::amx`), where hemi's
        // GEMM would run the product on `amx-bf16`; else BF16 pairs or F32 planes read from
        // the image as stored (`cpu::conv::wgrad`).
        let amx = (T::DTYPE == DType::BF16)
            .then(|| amx_wgrad_plan(g))
            .flatten();
        let dw = if let (Some(xb), Some(dyb), Some(plan)) =
            (same_slice::<T, bf16>(x), same_slice::<T, bf16>(dy), amx)
        {
            Some(wgrad_runs(xb, dyb, g, |x, dy, n, dw, _| {
                plan.add_weight_grad(x, dy, n, dw)
            }))
        } else if let (Some(xb), Some(dyb), Some(plan)) = (
            same_slice::<T, bf16>(x),
            same_slice::<T, bf16>(dy),
            WgradPlan::new(g),
        ) {
            Some(wgrad_runs(xb, dyb, g, |x, dy, n, dw, par| {
                plan.add_images(x, dy, n, dw, par)
            }))
        } else if let (Some(xf), Some(dyf), Some(plan)) = (
            same_slice::<T, f32>(x),
            same_slice::<T, f32>(dy),
            WgradPlan::new_f32(g),
        ) {
            Some(wgrad_runs(xf, dyf, g, |x, dy, n, dw, par| {
                plan.add_images_f32(x, dy, n, dw, par)
            }))
        } else if let (Some(xh), Some(dyh), Some(plan)) = (
            same_slice::<T, f16>(x),
            same_slice::<T, f16>(dy),
            WgradPlan::new_f32(g),
        ) {
            // F16: each run widened to F32 (exact), then the F32 plan's dot products, so the
            // bits of the F32 weight gradient of the same values. Through im2col and the GEMM
            // it took 1.65x as long as F32 on ResNet-20's 16-channel stage (Emerald Rapids).
            Some(wgrad_runs(xh, dyh, g, |x, dy, n, dw, par| {
                let (xf, dyf) = (
                    crate::dtype::convert::f16_to_f32_vec(x),
                    crate::dtype::convert::f16_to_f32_vec(dy),
                );
                plan.add_images_f32(&xf, &dyf, n, dw, par)
            }))
        } else {
            // Output channels a multiple of 32: an implicit GEMM (`cpu::conv::implicit`).
            implicit_wgrad_plan::<T>(g).map(|plan| {
                wgrad_runs(x, dy, g, |x, dy, n, dw, _| {
                    implicit_wgrad(&plan, x, dy, n, dw)
                })
            })
        };
        if let Some(dw) = dw {
            return dw.into_iter().map(|v| C::from_f64(f64::from(v))).collect();
        }
    }
    let runs = Runs::new(g.n, 1, 1);
    let (l, k, m) = (g.l(), g.k(), g.c_out_g());
    runs.sum_init(len, Vec::new, |scratch, r| {
        let mut dw = vec![C::zero(); len];
        for i in runs.range(r, g.n) {
            let xi = &x[i * g.in_image()..(i + 1) * g.in_image()];
            let dyi = &dy[i * g.out_image()..(i + 1) * g.out_image()];
            let col = columns(xi, scratch, g);
            for grp in 0..g.groups {
                let a = MatRef::row_major(&dyi[grp * m * l..(grp + 1) * m * l], m, l);
                let bt = MatRef::row_major(&col[grp * k * l..(grp + 1) * k * l], k, l).t();
                // A single run (one image) lets the GEMM use the threads itself (its
                // results do not depend on how many).
                let dst = &mut dw[grp * m * k..(grp + 1) * m * k];
                product(dst, a, bt, true, runs.count == 1);
            }
        }
        dw
    })
}

/// A weight gradient from the image (`cpu::conv::wgrad`) over runs of images of at least 2048
/// pixels (so that small planes do not pay a run's sums every few chunks), fixed by the batch,
/// each summed by `add(x, dy, images, dw, parallel)` into its own buffer, the buffers added in
/// run order.
fn wgrad_runs<E: Sync>(
    x: &[E],
    dy: &[E],
    g: &Conv2dGeom,
    add: impl Fn(&[E], &[E], usize, &mut [f32], bool) + Sync,
) -> Vec<f32> {
    let len = g.weight_len();
    let runs = Runs::new(g.n, 1, 2048usize.div_ceil(g.l()));
    let parallel = runs.count < rayon::current_num_threads();
    runs.sum_init(
        len,
        || (),
        |_, r| {
            let mut dw = vec![0f32; len];
            let images = runs.range(r, g.n);
            let xi = &x[images.start * g.in_image()..images.end * g.in_image()];
            let dyi = &dy[images.start * g.out_image()..images.end * g.out_image()];
            add(xi, dyi, images.len(), &mut dw, parallel);
            dw
        },
    )
}

/// Gradient of the bias in the compute type: `dy` summed over the batch and the output
/// pixels, per channel.
pub(crate) fn conv_bias_grad<C: FloatDType>(dy: &[C], g: &Conv2dGeom) -> Vec<C> {
    let l = g.l();
    (0..g.c_out)
        .map(|co| {
            (0..g.n)
                .map(|n| sum_slice(&dy[(n * g.c_out + co) * l..(n * g.c_out + co + 1) * l]))
                .fold(C::zero(), |a, b| a + b)
        })
        .collect()
}

/// The bias gradient (per channel, `dy` summed over images and pixels) from an F32/F16/BF16
/// gradient, an image at a time in F32; the same order as the compute-type path.
pub(crate) fn conv_bias_grad_blocks<T: WithDType>(dy: &[T], g: &Conv2dGeom) -> Vec<f32> {
    let l = g.l();
    let mut acc = vec![0f32; g.c_out];
    let mut db = vec![0f32; g.out_image()];
    for n in 0..g.n {
        let img = chunked::read(dy, n * g.out_image(), &mut db);
        for (co, a) in acc.iter_mut().enumerate() {
            *a += sum_slice(&img[co * l..(co + 1) * l]);
        }
    }
    acc
}

// F16/BF16 tensors are unfolded and multiplied as stored, without an F32 copy of the batch:
// the column matrix is unfolded in the tensor's own dtype (a gather, exact) and multiplied by
// hemi's blocked GEMM, which converts inside its packing (or, for BF16 on CPUs with AVX-512
// BF16, multiplies BF16 pairs with `vdpbf16ps`), with F32 results. Products of two F16 or two BF16
// values are exact in F32, so the half paths compute what the F32 kernels compute on the
// converted values, up to summation order (and, on the `avx512bf16` kernel, with subnormal
// inputs and partial sums flushed to zero, as `vdpbf16ps` does). On CPUs without AVX2
// it runs its portable kernel, slower than the `gemm` crate's SIMD code there.

// ----- F32/F16/BF16 tensors, results rounded image by image -----------------------------------
//
// For tensors that may be F16/BF16 (autocast's case): each image's F32 result is rounded
// straight into the output buffer, so the batch never exists in F32 (at batch 512 the F32
// copy of CifarNet's first activation gradient alone was 128 MiB).

// ----- BF16 convolutions in channel pairs ------------------------------------------------------
//
// The BF16-pair kernels read B as steps of NR u32, each the BF16 of two consecutive k indices.
// im2col's k order (channel, kernel row, kernel column) pairs two kernel offsets of one
// channel, two differently shifted runs of the plane, so the column matrix is built first
// and then packed (two passes over a matrix kh·kw times the image). Taking k in the order
// (channel pair, kernel row, kernel column, channel parity) instead pairs two channels at
// one offset: with the image's planes interleaved in pairs once (one pass over the image),
// each packed step is one shifted run of u32, the F32 unfold's copy (`gemm_unfold_pairs`).
// The weights are reordered to match (a zero channel pads an odd count). The products are
// the same; the pairs summed together differ, so the bits differ from im2col's within the
// F32 summation bound.

/// The plan of a BF16 convolution in channel pairs: the kernel, the weights in pair order
/// `[c_out, 2·ceil(c_in/2)·kh·kw]`, and the geometry over the pair planes.
struct PairConv {
    /// The pair-order weights packed for the kernel, once for the batch.
    packed: PackedA,
    pg: Conv2dGeom,
}

impl PairConv {
    /// `None` unless `g` is a stride-1 'same'-width, non-pointwise, ungrouped convolution
    /// whose product would run on a kernel that unfolds pairs (`avx512bf16`, or the forced
    /// portable twin).
    fn new(w: &[bf16], g: &Conv2dGeom) -> Option<Self> {
        let cp = g.c_in.div_ceil(2);
        let pg = Conv2dGeom { c_in: cp, ..*g };
        let (m, kk) = (g.c_out, g.kh * g.kw);
        let kernel = kernel_for(DType::BF16, DType::BF16, m, 2 * cp * kk, g.l());
        if g.groups != 1 || !kernel.unfolds_pairs() || !Unfold::<f32>::reads(&pg) {
            return None;
        }
        let mut wp = vec![bf16::ZERO; m * 2 * cp * kk];
        for (o, row) in wp.chunks_exact_mut(2 * cp * kk).enumerate() {
            for c in 0..g.c_in {
                for r in 0..kk {
                    row[2 * ((c / 2) * kk + r) + c % 2] = w[(o * g.c_in + c) * kk + r];
                }
            }
        }
        let packed = PackedA::new(kernel, MatRef::row_major(&wp, m, 2 * cp * kk));
        Some(PairConv { packed, pg })
    }

    /// One image: `x [c_in, h, w]` interleaved into `pairs`, then `y [c_out, L] (+)= w · col`.
    fn image(&self, x: &[bf16], y: &mut [f32], pairs: &mut Vec<f32>, acc: bool, par: bool) {
        let hw = self.pg.h * self.pg.w;
        pair_planes(x, hw, self.pg.c_in, pairs);
        let u = Unfold::conv(pairs, &self.pg, 0).expect("checked by PairConv::new");
        gemm_unfold_pairs_packed(y, &self.packed, u, acc, par);
    }
}

/// `out[cp·hw + i]` = the bits of `x[2cp][i]` (low half) and `x[2cp + 1][i]` (high half, zero
/// past the last channel) as one u32, read as F32 bits (only moved, never computed with).
fn pair_planes(x: &[bf16], hw: usize, cp: usize, out: &mut Vec<f32>) {
    out.resize(cp * hw, 0.0);
    let c = x.len() / hw.max(1);
    for (p, dst) in out.chunks_exact_mut(hw).enumerate() {
        let lo = &x[2 * p * hw..][..hw];
        if 2 * p + 1 < c {
            let hi = &x[(2 * p + 1) * hw..][..hw];
            for ((d, l), h) in dst.iter_mut().zip(lo).zip(hi) {
                *d = f32::from_bits(l.to_bits() as u32 | (h.to_bits() as u32) << 16);
            }
        } else {
            for (d, l) in dst.iter_mut().zip(lo) {
                *d = f32::from_bits(l.to_bits() as u32);
            }
        }
    }
}

/// `conv2d_forward` over contiguous `x` and `w` of one dtype `T` (F32/F16/BF16), F32
/// bias: the output in `T`, each image's F32 result rounded into it.
pub fn conv2d_forward_blocks<T: WithDType>(
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    g: &Conv2dGeom,
) -> CpuStorage {
    if let (Some(xb), Some(wb)) = (same_slice::<T, bf16>(x), same_slice::<T, bf16>(w)) {
        if let Some(plan) = PairConv::new(wb, g) {
            return per_block_with(g.n, g.out_image(), T::DTYPE, Vec::new, |pairs, i, y| {
                if let Some(bias) = bias {
                    fill_rows(y, g.l(), bias);
                }
                let xi = &xb[i * g.in_image()..(i + 1) * g.in_image()];
                plan.image(xi, y, pairs, bias.is_some(), g.n == 1);
            })
            .expect("BF16");
        }
    }
    let prep = Prepared::new::<T, f32>(w, g);
    if let (Some(plan), Some(xb)) = (&prep.amx, same_slice::<T, bf16>(x)) {
        // The AMX route rounds each output run to BF16 as it stores it (no F32 image) and
        // writes every output, so the blocks are not zeroed first.
        let image = |_: &mut (), i, y: &mut [MaybeUninit<bf16>]| {
            plan.image(&xb[i * g.in_image()..(i + 1) * g.in_image()], bias, y);
        };
        // SAFETY: `AmxConvPlan::image` writes every element of its output.
        let y = unsafe { blocks_uninit(g.n, g.out_image(), 1, || (), image) };
        return CpuStorage::BF16(y);
    }
    per_block_with(g.n, g.out_image(), T::DTYPE, Vec::new, |col, i, y| {
        let xi = &x[i * g.in_image()..(i + 1) * g.in_image()];
        image_forward(xi, w, &prep, bias, y, col, g, g.n == 1);
    })
    .expect("F32, F16 or BF16")
}

/// `conv2d_backward_input` from contiguous `dy` and `w` of one dtype `T` (F32/F16/BF16);
/// `dx` in `T`.
pub fn conv2d_backward_input_blocks<T: WithDType>(dy: &[T], w: &[T], g: &Conv2dGeom) -> CpuStorage {
    if let Some((wt, tg)) = transposed_input_conv(w, g) {
        return conv2d_forward_blocks(dy, &wt, None, &tg);
    }
    // Strided BF16: phase by phase of dx on AMX tiles (`cpu::conv::amx`), where hemi's GEMM
    // would run `wᵀ · dy` on `amx-bf16`.
    if let (Some(dyb), Some(wb)) = (same_slice::<T, bf16>(dy), same_slice::<T, bf16>(w)) {
        let plan = amx_gemm(g.k(), g.c_out_g(), g.l())
            .then(|| AmxInputGradPlan::new(g, wb))
            .flatten();
        if let Some(plan) = plan {
            let image = |_: &mut (), i, dx: &mut [MaybeUninit<bf16>]| {
                let dyi = &dyb[i * g.out_image()..(i + 1) * g.out_image()];
                plan.image(dyi, dx, MaybeUninit::new(bf16::ZERO));
            };
            // SAFETY: `AmxInputGradPlan::image` writes every element of its output.
            let dx = unsafe { blocks_uninit(g.n, g.in_image(), 1, || (), image) };
            return CpuStorage::BF16(dx);
        }
    }
    let packed = transposed_packed(w, g);
    per_block_with(g.n, g.in_image(), T::DTYPE, Vec::new, |dcol, i, dx| {
        if g.out_image() > 0 {
            let dyi = &dy[i * g.out_image()..(i + 1) * g.out_image()];
            image_backward_input(dyi, w, packed.as_deref(), dx, dcol, g, g.n == 1);
        }
    })
    .expect("F32, F16 or BF16")
}
