//! The fused block `conv2d_relu_max_pool2` against the three ops it replaces, computed in
//! F64: cases and checks shared by `conv_block.rs` and `gemm_kernels.rs` (which runs them on
//! a forced GEMM kernel).

use super::*;
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Generator, Tensor};

/// (input [n, c_in, h, w], weight [c_out, c_in/groups, kh, kw], options, bias).
pub type Case = ([usize; 4], [usize; 4], Conv2dOptions, bool);

pub fn cases() -> Vec<Case> {
    let o = Conv2dOptions::default();
    vec![
        // Odd conv output (9×7): the pool drops the last row and column.
        ([3, 5, 11, 9], [4, 5, 3, 3], o, true),
        ([2, 3, 12, 10], [6, 3, 3, 2], o.stride(2).padding(1), false),
        ([3, 6, 9, 8], [4, 3, 3, 3], o.groups(2).padding(1), true),
        // Pointwise (the column matrix is the image) and a single image.
        ([2, 7, 6, 5], [3, 7, 1, 1], o, true),
        ([1, 3, 16, 13], [8, 3, 3, 3], o.dilation(2), true),
        // Several images per GEMM (the kernel groups images to >= 128 columns: 4 of 36
        // here) with a partial last group, in the forward (4 + 4 + 1) and in each thread's
        // run of the backward (4 + 1 and 4 on two threads).
        ([9, 4, 6, 6], [6, 4, 3, 3], o.padding(1), true),
        // CifarNet's first block at batch 2.
        ([2, 3, 32, 32], [64, 3, 3, 3], o, true),
    ]
}

pub fn f64_tensor(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_f64_vec(v.to_vec(), shape, DType::F64).unwrap()
}

/// What the block computes, in F64 through the unfused ops, for output gradient `gy`:
/// output, gradients, and the sums of |terms| of each (for the error bounds).
struct Reference {
    y: Vec<f64>,
    y_abs: Vec<f64>,
    dx: Vec<f64>,
    dx_abs: Vec<f64>,
    dw: Vec<f64>,
    dw_abs: Vec<f64>,
    db: Vec<f64>,
    db_abs: Vec<f64>,
}

fn reference(
    case: &Case,
    x: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    gy: &[f64],
    y_shape: &[usize],
) -> Reference {
    let (xs, ws, opts, _) = case;
    let (xt, wt) = (
        f64_tensor(x, xs).requires_grad_(),
        f64_tensor(w, ws).requires_grad_(),
    );
    let bt = b.map(|b| f64_tensor(b, &[ws[0]]).requires_grad_());
    let conv = xt.conv2d(&wt, bt.as_ref(), *opts).unwrap();
    // The gradient at the convolution's output, from a leaf holding its values.
    let yc = f64_tensor(&conv.to_vec_f64(), conv.shape()).requires_grad_();
    let y = yc
        .relu()
        .unwrap()
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .unwrap();
    assert_eq!(y.shape(), y_shape);
    let gyt = f64_tensor(gy, y_shape);
    y.mul(&gyt).unwrap().sum_all().unwrap().backward().unwrap();
    let dyc = yc.grad().unwrap();
    conv.mul(&dyc)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // |terms|: the same products on absolute values.
    let (xa, wa) = (
        f64_tensor(x, xs).abs().unwrap().requires_grad_(),
        f64_tensor(w, ws).abs().unwrap().requires_grad_(),
    );
    let ba = b.map(|b| f64_tensor(b, &[ws[0]]).abs().unwrap());
    let conv_abs = xa.conv2d(&wa, ba.as_ref(), *opts).unwrap();
    let dyc_abs = dyc.abs().unwrap();
    conv_abs
        .mul(&dyc_abs)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // The pooled |terms| are those of the maximum's convolution output (any window
    // element's bound covers it: take the window's largest).
    let y_abs = conv_abs
        .detach()
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .unwrap()
        .to_vec_f64();
    let db = dyc.sum(&[0, 2, 3], false).unwrap().to_vec_f64();
    let db_abs = dyc_abs.sum(&[0, 2, 3], false).unwrap().to_vec_f64();
    Reference {
        y: y.to_vec_f64(),
        y_abs,
        dx: xt.grad().unwrap().to_vec_f64(),
        dx_abs: xa.grad().unwrap().to_vec_f64(),
        dw: wt.grad().unwrap().to_vec_f64(),
        dw_abs: wa.grad().unwrap().to_vec_f64(),
        db,
        db_abs,
    }
}

/// `block_matches_reference_on` in a pool of two threads, so that the backward's per-thread
/// runs split the batch as the grouping case's comment says on any machine.
pub fn block_matches_reference(dtype: DType) {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
        .install(|| block_matches_reference_on(dtype))
}

fn block_matches_reference_on(dtype: DType) {
    let mut rng = Generator::new(31);
    for (ci, case) in cases().iter().enumerate() {
        let (xs, ws, opts, has_bias) = *case;
        let strided = ci % 2 == 1;
        let (x, xv) = rand_tensor(&xs, dtype, strided, &mut rng);
        let (w, wv) = rand_tensor(&ws, dtype, false, &mut rng);
        let (b, bv) = if has_bias {
            let (b, bv) = rand_tensor(&[ws[0]], dtype, false, &mut rng);
            (Some(b.requires_grad_()), Some(bv))
        } else {
            (None, None)
        };
        let (x, w) = (x.requires_grad_(), w.requires_grad_());
        let y = x.conv2d_relu_max_pool2(&w, b.as_ref(), opts).unwrap();
        assert_eq!(y.dtype(), dtype);
        let gyv = rand_values(y.numel(), -1.0, 1.0, dtype, &mut rng);
        let gy = Tensor::from_f64_vec(gyv.clone(), y.shape(), dtype).unwrap();
        y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
        let r = reference(case, &xv, &wv, bv.as_deref(), &gyv, y.shape());
        let what = format!("{dtype} {case:?}");
        let (l, k) = {
            let (ho, wo) = (y.shape()[2] * 2, y.shape()[3] * 2);
            (ho * wo, ws[1] * ws[2] * ws[3])
        };
        // The output: a sum of k products and the bias, rounded once (ReLU and max are
        // exact on it).
        let got = y.to_vec_f64();
        assert_sums_close(&format!("{what} y"), &got, &r.y, &r.y_abs, k + 1, dtype);
        // dx: each input pixel gets at most c_out/groups·kh·kw products.
        let dx = x.grad().unwrap();
        assert_eq!(dx.dtype(), dtype);
        let terms = ws[0] / opts.groups * ws[2] * ws[3];
        assert_sums_close(
            &format!("{what} dx"),
            &dx.to_vec_f64(),
            &r.dx,
            &r.dx_abs,
            terms,
            dtype,
        );
        // dw, db: sums over the batch and the (full-resolution) output pixels.
        let terms = xs[0] * l;
        let dw = w.grad().unwrap().to_vec_f64();
        assert_sums_close(&format!("{what} dw"), &dw, &r.dw, &r.dw_abs, terms, dtype);
        if let Some(b) = &b {
            let db = b.grad().unwrap().to_vec_f64();
            assert_sums_close(&format!("{what} db"), &db, &r.db, &r.db_abs, terms, dtype);
        }
    }
}
