//! max_pool2d (values and indices), avg_pool2d and adaptive_avg_pool2d against plain f64
//! references, per dtype (forward and backward), gradients by finite differences in F64,
//! PyTorch's tie and padding rules, and the errors they report.

use crate::common;
use common::*;
use hemi::{DType, Error, Generator, Tensor};

/// A windowed pool: kernel, stride, padding.
type Window = ((usize, usize), (usize, usize), (usize, usize));

/// The windows every dtype runs: odd and overlapping windows, padding, CifarNet's 2x2,
/// ResNet's 1×1 subsampling (its own gather path).
const WINDOWS: [Window; 8] = [
    ((2, 2), (2, 2), (0, 0)),
    ((3, 2), (2, 1), (1, 1)),
    ((3, 3), (1, 1), (1, 1)),
    ((3, 3), (2, 3), (0, 1)),
    ((1, 1), (2, 2), (0, 0)),
    ((1, 1), (3, 2), (0, 0)),
    // Non-overlapping windows over padding (the gradient's scatter in the stored dtype).
    ((2, 2), (2, 2), (1, 1)),
    ((3, 3), (3, 3), (1, 0)),
];

/// Input shapes: odd sizes, a 3-D [C, H, W] input, size-1 dims.
const SHAPES: [&[usize]; 3] = [&[3, 5, 11, 9], &[4, 7, 6], &[1, 1, 5, 3]];

fn out_size(size: usize, k: usize, s: usize, p: usize) -> usize {
    (size + 2 * p - k) / s + 1
}

/// The window of output `o` in input coordinates, clipped: `[o*s - p, o*s - p + k) ∩ [0, size)`,
/// and its unclipped size within the padded input.
fn window(o: usize, k: usize, s: usize, p: usize, size: usize) -> (usize, usize, usize) {
    let start = (o * s) as isize - p as isize;
    let end = start + k as isize;
    let padded = end.min((size + p) as isize) - start;
    (
        start.max(0) as usize,
        end.min(size as isize) as usize,
        padded as usize,
    )
}

/// Splits a shape into (planes, h, w).
fn planes(shape: &[usize]) -> (usize, usize, usize) {
    let r = shape.len();
    (shape[..r - 2].iter().product(), shape[r - 2], shape[r - 1])
}

/// What a reference pool gives for each output: its value, the input elements it reads
/// with their weights (for the backward), and the flat index of the max.
struct PoolRef {
    y: Vec<f64>,
    /// Per output: (flat input index in the whole tensor, weight d y / d x).
    taps: Vec<Vec<(usize, f64)>>,
    idx: Vec<i64>,
    out_shape: Vec<usize>,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Max,
    Avg { include_pad: bool },
}

fn pool_reference(x: &[f64], shape: &[usize], kind: Kind, (k, s, p): Window) -> PoolRef {
    let (np, h, w) = planes(shape);
    let (ho, wo) = (out_size(h, k.0, s.0, p.0), out_size(w, k.1, s.1, p.1));
    let mut r = PoolRef {
        y: vec![],
        taps: vec![],
        idx: vec![],
        out_shape: [&shape[..shape.len() - 2], &[ho, wo]].concat(),
    };
    for pl in 0..np {
        for oh in 0..ho {
            let (hs, he, hp) = window(oh, k.0, s.0, p.0, h);
            for ow in 0..wo {
                let (ws, we, wp) = window(ow, k.1, s.1, p.1, w);
                let cells: Vec<usize> = (hs..he)
                    .flat_map(|i| (ws..we).map(move |j| i * w + j))
                    .collect();
                let at = |c: usize| pl * h * w + c;
                match kind {
                    Kind::Max => {
                        // First maximum in row-major order.
                        let mut best = cells[0];
                        for &c in &cells {
                            if x[at(c)] > x[at(best)] {
                                best = c;
                            }
                        }
                        r.y.push(x[at(best)]);
                        r.idx.push(best as i64);
                        r.taps.push(vec![(at(best), 1.0)]);
                    }
                    Kind::Avg { include_pad } => {
                        let div = if include_pad { hp * wp } else { cells.len() } as f64;
                        r.y.push(cells.iter().map(|&c| x[at(c)]).sum::<f64>() / div);
                        r.taps
                            .push(cells.iter().map(|&c| (at(c), 1.0 / div)).collect());
                    }
                }
            }
        }
    }
    r
}

fn adaptive_reference(x: &[f64], shape: &[usize], (ho, wo): (usize, usize)) -> PoolRef {
    let (np, h, w) = planes(shape);
    let win = |i: usize, out: usize, size: usize| {
        let start = (i * size) as f64 / out as f64;
        let end = ((i + 1) * size) as f64 / out as f64;
        (start.floor() as usize, end.ceil() as usize)
    };
    let mut r = PoolRef {
        y: vec![],
        taps: vec![],
        idx: vec![],
        out_shape: [&shape[..shape.len() - 2], &[ho, wo]].concat(),
    };
    for pl in 0..np {
        for oh in 0..ho {
            let (hs, he) = win(oh, ho, h);
            for ow in 0..wo {
                let (ws, we) = win(ow, wo, w);
                let cells: Vec<usize> = (hs..he)
                    .flat_map(|i| (ws..we).map(move |j| pl * h * w + i * w + j))
                    .collect();
                let n = cells.len() as f64;
                r.y.push(cells.iter().map(|&c| x[c]).sum::<f64>() / n);
                r.taps.push(cells.iter().map(|&c| (c, 1.0 / n)).collect());
            }
        }
    }
    r
}

impl PoolRef {
    /// The input gradient for output gradient `gy`, and the sum of |terms| of each entry.
    fn backward(&self, n_in: usize, gy: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (mut dx, mut abs) = (vec![0.0; n_in], vec![0.0; n_in]);
        for (taps, &g) in self.taps.iter().zip(gy) {
            for &(i, wgt) in taps {
                dx[i] += g * wgt;
                abs[i] += (g * wgt).abs();
            }
        }
        (dx, abs)
    }
    /// Sum of |terms| of each output (for the bound on averages).
    fn y_abs(&self, x: &[f64]) -> Vec<f64> {
        self.taps
            .iter()
            .map(|t| t.iter().map(|&(i, w)| (x[i] * w).abs()).sum())
            .collect()
    }
}

/// Runs `op` forward and backward (output gradient `gy` through sum(y * gy)) on an input
/// of `shape`, returning the reference, the output, the input's values and its gradient.
fn run(
    dtype: DType,
    shape: &[usize],
    strided: bool,
    rng: &mut Generator,
    op: impl Fn(&Tensor) -> Tensor,
    reference: impl Fn(&[f64]) -> PoolRef,
) -> (PoolRef, Tensor, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (x, xv) = rand_tensor(shape, dtype, strided, rng);
    let x = x.requires_grad_();
    let y = op(&x);
    let r = reference(&xv);
    assert_eq!(y.shape(), r.out_shape, "{shape:?}");
    assert_eq!(y.dtype(), dtype);
    let gyv = rand_values(y.numel(), -1.0, 1.0, dtype, rng);
    let gy = Tensor::from_f64_vec(gyv.clone(), y.shape(), dtype).unwrap();
    y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), dtype);
    let (dx_want, dx_abs) = r.backward(xv.len(), &gyv);
    (r, y, xv, g.to_vec_f64(), dx_want, dx_abs)
}

fn max_pool(dtype: DType) {
    let mut rng = Generator::new(11);
    for (si, shape) in SHAPES.iter().enumerate() {
        for (wi, &win) in WINDOWS.iter().enumerate() {
            let (k, s, p) = win;
            if shape[shape.len() - 1] + 2 * p.1 < k.1 {
                continue;
            }
            let what = format!("{dtype} max_pool2d {shape:?} {win:?}");
            let strided = (si + wi) % 2 == 1;
            let (r, y, _, dx, dx_want, dx_abs) = run(
                dtype,
                shape,
                strided,
                &mut rng,
                |x| x.max_pool2d(k, s, p).unwrap(),
                |xv| pool_reference(xv, shape, Kind::Max, win),
            );
            // A max is one of the inputs: exact in every dtype.
            assert_eq!(y.to_vec_f64(), r.y, "{what}");
            // Overlapping windows add gradients: at most k.0*k.1 terms per input.
            assert_sums_close(&what, &dx, &dx_want, &dx_abs, k.0 * k.1, dtype);
        }
    }
}
dtype_tests!(max_pool_matches_reference, super::max_pool);

/// Max pools whose output gradient arrives as a channel slice of a wider one (ResNet's
/// padded shortcut: the pool's output concatenated with zeros), so not contiguous: the input
/// gradient equals the reference's, for non-overlapping windows (the scatter in the stored
/// dtype) and overlapping ones; a −0 gradient lands as +0, as the sum `0 + (−0)` gives.
fn max_pool_strided_gradient(dtype: DType) {
    let mut rng = Generator::new(13);
    let shape = [2, 3, 7, 6];
    for win in [
        WINDOWS[0], WINDOWS[1], WINDOWS[4], WINDOWS[5], WINDOWS[6], WINDOWS[7],
    ] {
        let (k, s, p) = win;
        let what = format!("{dtype} max_pool2d {win:?} through cat");
        let (x, xv) = rand_tensor(&shape, dtype, false, &mut rng);
        let x = x.requires_grad_();
        let y = x.max_pool2d(k, s, p).unwrap();
        let mut zshape = y.shape().to_vec();
        zshape[1] = 2;
        let zeros = Tensor::zeros(&zshape, dtype).unwrap();
        let z = Tensor::cat(&[&zeros, &y, &zeros], 1).unwrap();
        let mut gzv = rand_values(z.numel(), -1.0, 1.0, dtype, &mut rng);
        gzv[2 * y.numel() / 3 + 5] = -0.0;
        let gz = Tensor::from_f64_vec(gzv.clone(), z.shape(), dtype).unwrap();
        z.mul(&gz).unwrap().sum_all().unwrap().backward().unwrap();
        // The gradient y received: channels 2..5 of gz.
        let per = y.numel() / shape[0];
        let plane = per / shape[1];
        let gyv: Vec<f64> = (0..y.numel())
            .map(|i| gzv[(i / per) * (per + 4 * plane) + 2 * plane + i % per])
            .collect();
        let r = pool_reference(&xv, &shape, Kind::Max, win);
        let (want, abs) = r.backward(xv.len(), &gyv);
        let got = x.grad().unwrap().to_vec_f64();
        assert_sums_close(&what, &got, &want, &abs, k.0 * k.1, dtype);
        assert!(
            got.iter().all(|v| v.to_bits() != (-0.0f64).to_bits()),
            "{what}: a −0 in the input gradient"
        );
    }
}
dtype_tests!(
    max_pool_strided_gradient_matches_reference,
    super::max_pool_strided_gradient
);

/// The indices are PyTorch's flat `h*W + w` per plane, as I64, and the values match.
fn max_pool_indices(dtype: DType) {
    let mut rng = Generator::new(12);
    for shape in SHAPES {
        for win in WINDOWS {
            let (k, s, p) = win;
            if shape[shape.len() - 1] + 2 * p.1 < k.1 {
                continue;
            }
            let (x, xv) = rand_tensor(shape, dtype, true, &mut rng);
            let (y, idx) = x.max_pool2d_with_indices(k, s, p).unwrap();
            let r = pool_reference(&xv, shape, Kind::Max, win);
            assert_eq!(idx.dtype(), DType::I64);
            assert_eq!(idx.shape(), y.shape());
            assert_eq!(idx.to_vec_i64(), r.idx, "{dtype} {shape:?} {win:?}");
            assert_eq!(y.to_vec_f64(), r.y);
        }
    }
}
dtype_tests!(max_pool_indices_match_reference, super::max_pool_indices);

fn avg_pool(dtype: DType) {
    let mut rng = Generator::new(13);
    for (si, shape) in SHAPES.iter().enumerate() {
        for (wi, &win) in WINDOWS.iter().enumerate() {
            for include_pad in [true, false] {
                let (k, s, p) = win;
                if shape[shape.len() - 1] + 2 * p.1 < k.1 {
                    continue;
                }
                let what = format!("{dtype} avg_pool2d {shape:?} {win:?} {include_pad}");
                let (r, y, xv, dx, dx_want, dx_abs) = run(
                    dtype,
                    shape,
                    (si + wi) % 2 == 0,
                    &mut rng,
                    |x| x.avg_pool2d(k, s, p, include_pad).unwrap(),
                    |xv| pool_reference(xv, shape, Kind::Avg { include_pad }, win),
                );
                // A window sum of k.0*k.1 terms and a division.
                let terms = k.0 * k.1 + 1;
                assert_sums_close(&what, &y.to_vec_f64(), &r.y, &r.y_abs(&xv), terms, dtype);
                // Each input gets one divided gradient per window covering it.
                assert_sums_close(&what, &dx, &dx_want, &dx_abs, 2 * k.0 * k.1, dtype);
            }
        }
    }
}
dtype_tests!(avg_pool_matches_reference, super::avg_pool);

fn adaptive_pool(dtype: DType) {
    let mut rng = Generator::new(14);
    // Shrinking, uneven (overlapping) windows, growing, identity and global pooling.
    let sizes = [(3, 2), (4, 5), (13, 11), (11, 9), (1, 1)];
    for (i, shape) in [&[3usize, 5, 11, 9][..], &[2, 7, 6]].iter().enumerate() {
        for (j, &out) in sizes.iter().enumerate() {
            let what = format!("{dtype} adaptive_avg_pool2d {shape:?} -> {out:?}");
            let (r, y, xv, dx, dx_want, dx_abs) = run(
                dtype,
                shape,
                (i + j) % 2 == 1,
                &mut rng,
                |x| x.adaptive_avg_pool2d(out).unwrap(),
                |xv| adaptive_reference(xv, shape, out),
            );
            let (_, h, w) = planes(shape);
            // The largest window: ceil(H/out)+1 rows by ceil(W/out)+1 columns at most.
            let terms = (h.div_ceil(out.0) + 1) * (w.div_ceil(out.1) + 1) + 1;
            assert_sums_close(&what, &y.to_vec_f64(), &r.y, &r.y_abs(&xv), terms, dtype);
            // An input is covered by at most out/H + 2 windows per dim.
            let cover = (out.0 / h + 2) * (out.1 / w + 2);
            assert_sums_close(&what, &dx, &dx_want, &dx_abs, 2 * cover, dtype);
        }
    }
}
dtype_tests!(adaptive_pool_matches_reference, super::adaptive_pool);

/// Ties go to the first maximum in row-major order; padding is -inf (an all-negative
/// input never pools to 0); NaN propagates.
#[test]
fn max_pool_ties_padding_nan() {
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::full(&[1, 1, 4, 4], -5.0, dtype).unwrap();
        let (y, idx) = x.max_pool2d_with_indices((3, 3), (2, 2), (1, 1)).unwrap();
        assert_eq!(y.to_vec_f64(), vec![-5.0; 4]);
        // Windows start at (-1,-1), (-1,1), (1,-1), (1,1): first valid cells.
        assert_eq!(idx.to_vec_i64(), vec![0, 1, 4, 5]);
        let v = vec![1.0, f64::NAN, 3.0, 3.0];
        let x = Tensor::from_f64_vec(v, &[1, 2, 2], dtype).unwrap();
        let (y, idx) = x.max_pool2d_with_indices((1, 2), (1, 2), (0, 0)).unwrap();
        let y = y.to_vec_f64();
        assert!(y[0].is_nan() && y[1] == 3.0, "{y:?}");
        assert_eq!(idx.to_vec_i64(), vec![1, 2]);
        // The 2×2 stride-2 fast path keeps the same rules: a tie goes to the first cell
        // (row-major), the last NaN wins, a NaN before a larger value still wins.
        let v = vec![
            1.0,
            3.0,
            f64::NAN,
            5.0,
            7.0, //
            3.0,
            2.0,
            f64::NAN,
            0.0,
            9.0,
        ];
        let x = Tensor::from_f64_vec(v, &[1, 1, 2, 5], dtype).unwrap();
        let (y, idx) = x.max_pool2d_with_indices((2, 2), (2, 2), (0, 0)).unwrap();
        let y = y.to_vec_f64();
        assert!(y[0] == 3.0 && y[1].is_nan(), "{y:?}");
        assert_eq!(idx.to_vec_i64(), vec![1, 7]);
        // The 1×1 gather keeps a NaN where it lands.
        let (y, idx) = x.max_pool2d_with_indices((1, 1), (1, 2), (0, 0)).unwrap();
        let y = y.to_vec_f64();
        assert!(
            y[0] == 1.0 && y[1].is_nan() && y[4].is_nan() && y[5] == 9.0,
            "{y:?}"
        );
        assert_eq!(idx.to_vec_i64(), vec![0, 2, 4, 5, 7, 9]);
    }
}

/// Padding counts in the divisor by default (PyTorch's count_include_pad=True).
#[test]
fn avg_pool_padding_divisor() {
    let x = Tensor::ones(&[1, 1, 2, 2], DType::F32).unwrap();
    let y = x.avg_pool2d((2, 2), (1, 1), (1, 1), true).unwrap();
    assert_eq!(
        y.to_vec_f64(),
        vec![0.25, 0.5, 0.25, 0.5, 1.0, 0.5, 0.25, 0.5, 0.25]
    );
    let y = x.avg_pool2d((2, 2), (1, 1), (1, 1), false).unwrap();
    assert_eq!(y.to_vec_f64(), vec![1.0; 9]);
}

/// Gradients by finite differences in F64. Max pooling gets distinct values spaced far
/// more than the step apart, so no perturbation changes an argmax.
#[test]
fn pool_gradcheck() {
    let mut rng = Generator::new(15);
    let shape = [2usize, 2, 5, 6];
    let n: usize = shape.iter().product();
    // A shuffled ramp: distinct values 0.01 apart.
    let mut ramp: Vec<f64> = (0..n).map(|i| i as f64 * 0.01 - 1.0).collect();
    for i in (1..n).rev() {
        ramp.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for (k, s, p) in [
        ((2, 2), (2, 2), (0, 0)),
        ((3, 2), (2, 1), (1, 1)),
        ((3, 3), (1, 1), (1, 0)),
    ] {
        gradcheck(
            &format!("max_pool2d {k:?} {s:?} {p:?}"),
            &[(ramp.clone(), shape.to_vec())],
            |xs| xs[0].max_pool2d(k, s, p),
        );
        for include_pad in [true, false] {
            gradcheck(
                &format!("avg_pool2d {k:?} {s:?} {p:?} {include_pad}"),
                &[grad_input(&shape, &mut rng)],
                |xs| xs[0].avg_pool2d(k, s, p, include_pad),
            );
        }
    }
    for out in [(2, 4), (3, 3), (7, 8), (1, 1)] {
        gradcheck(
            &format!("adaptive_avg_pool2d {out:?}"),
            &[grad_input(&shape, &mut rng)],
            |xs| xs[0].adaptive_avg_pool2d(out),
        );
    }
}

#[test]
fn pool_errors() {
    let x = Tensor::zeros(&[2, 3, 6, 5], DType::F32).unwrap();
    let arg = |r: hemi::Result<Tensor>, op: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Arg { .. }), "{e}");
        assert!(e.to_string().starts_with(op), "{e}");
    };
    let shape = |r: hemi::Result<Tensor>, op: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        assert!(e.to_string().starts_with(op), "{e}");
        assert!(e.to_string().contains('['), "names the shape: {e}");
    };
    // Padding above half the kernel, zero kernel, zero stride.
    arg(x.max_pool2d((2, 2), (2, 2), (2, 0)), "max_pool2d");
    arg(x.avg_pool2d((3, 3), (1, 1), (0, 2), true), "avg_pool2d");
    arg(x.max_pool2d((0, 2), (1, 1), (0, 0)), "max_pool2d");
    arg(x.max_pool2d((2, 2), (0, 1), (0, 0)), "max_pool2d");
    arg(x.adaptive_avg_pool2d((0, 3)), "adaptive_avg_pool2d");
    // Kernel larger than the (padded) input; wrong ranks; empty spatial dims.
    shape(x.max_pool2d((7, 2), (1, 1), (0, 0)), "max_pool2d");
    shape(x.avg_pool2d((2, 6), (1, 1), (0, 0), false), "avg_pool2d");
    let flat = Tensor::zeros(&[6, 5], DType::F32).unwrap();
    shape(flat.max_pool2d((2, 2), (2, 2), (0, 0)), "max_pool2d");
    shape(flat.adaptive_avg_pool2d((2, 2)), "adaptive_avg_pool2d");
    let empty = Tensor::zeros(&[2, 3, 0, 5], DType::F32).unwrap();
    shape(empty.adaptive_avg_pool2d((2, 2)), "adaptive_avg_pool2d");
    // Integer input.
    let xi = Tensor::from_vec(vec![0i64; 30], &[1, 6, 5]).unwrap();
    assert!(matches!(
        xi.max_pool2d((2, 2), (2, 2), (0, 0)).unwrap_err(),
        Error::DType { .. }
    ));
    // An empty batch pools to an empty batch.
    let e = Tensor::zeros(&[0, 3, 6, 5], DType::F32).unwrap();
    assert_eq!(
        e.max_pool2d((2, 2), (2, 2), (0, 0)).unwrap().shape(),
        [0, 3, 3, 2]
    );
}
