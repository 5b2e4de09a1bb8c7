//! conv2d against a direct 7-loop f64 convolution, per dtype (forward and backward), its
//! gradients by finite differences in F64, the CifarNet shapes, and the errors it reports.

use crate::common;
use common::*;
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Error, Generator, Tensor};

/// One convolution to test: input [n, c_in, h, w], weight [c_out, c_in/groups, kh, kw].
#[derive(Clone, Copy, Debug)]
struct Case {
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kh: usize,
    kw: usize,
    opts: Conv2dOptions,
    bias: bool,
}

impl Case {
    fn x_shape(&self) -> [usize; 4] {
        [self.n, self.c_in, self.h, self.w]
    }
    fn w_shape(&self) -> [usize; 4] {
        [self.c_out, self.c_in / self.opts.groups, self.kh, self.kw]
    }
    fn out_hw(&self) -> (usize, usize) {
        let o = &self.opts;
        let f = |size: usize, k: usize, s: usize, p: usize, d: usize| {
            (size + 2 * p - d * (k - 1) - 1) / s + 1
        };
        (
            f(self.h, self.kh, o.stride.0, o.padding.0, o.dilation.0),
            f(self.w, self.kw, o.stride.1, o.padding.1, o.dilation.1),
        )
    }
    fn y_shape(&self) -> [usize; 4] {
        let (ho, wo) = self.out_hw();
        [self.n, self.c_out, ho, wo]
    }
}

fn case(n: usize, c_in: usize, hw: (usize, usize), c_out: usize, k: (usize, usize)) -> Case {
    Case {
        n,
        c_in,
        h: hw.0,
        w: hw.1,
        c_out,
        kh: k.0,
        kw: k.1,
        opts: Conv2dOptions::default(),
        bias: true,
    }
}

/// The cases every dtype runs: odd sizes, stride, padding, dilation, groups 1/2/C, 1x1
/// kernels (the pointwise path and a strided one), a single image (parallel GEMM), a kernel
/// as large as the padded input, bias and no bias.
fn cases() -> Vec<Case> {
    let o = Conv2dOptions::default();
    vec![
        case(3, 5, (11, 9), 4, (3, 2)),
        Case {
            opts: o.stride(2).padding(1),
            bias: false,
            ..case(3, 5, (11, 9), 4, (3, 2))
        },
        Case {
            opts: Conv2dOptions {
                stride: (1, 2),
                padding: (2, 1),
                dilation: (2, 2),
                groups: 1,
            },
            ..case(2, 3, (10, 9), 5, (3, 3))
        },
        Case {
            opts: o.groups(2).padding(1),
            ..case(3, 6, (7, 8), 4, (3, 3))
        },
        // Depthwise with channel multiplier 2.
        Case {
            opts: o.groups(5).padding(1).stride(2),
            ..case(2, 5, (9, 7), 10, (3, 3))
        },
        case(3, 7, (5, 6), 3, (1, 1)),
        Case {
            opts: o.stride(2).groups(3),
            bias: false,
            ..case(2, 6, (7, 5), 9, (1, 1))
        },
        case(1, 3, (16, 13), 8, (3, 3)),
        Case {
            opts: o.padding(1),
            ..case(2, 2, (3, 4), 3, (5, 6))
        },
        // Stride 1 with dilation and uneven padding: the input gradient runs as a
        // convolution of dy with the flipped kernels (padding (k-1)·d - p = (3, 0)).
        Case {
            opts: Conv2dOptions {
                stride: (1, 1),
                padding: (1, 2),
                dilation: (2, 1),
                groups: 1,
            },
            ..case(2, 4, (9, 8), 6, (3, 3))
        },
        // Padding wider than the kernel reaches: the col2im route.
        Case {
            opts: Conv2dOptions {
                stride: (1, 1),
                padding: (1, 1),
                dilation: (1, 1),
                groups: 1,
            },
            ..case(2, 3, (6, 5), 4, (1, 3))
        },
        // Channels that BF16 on an AMX CPU runs on `cpu::conv::amx`: forward and weight
        // gradient from the image, the input gradient as the forward of the flipped kernels
        // (16 input channels: two taps per chunk), and a pointwise convolution whose input
        // gradient is the forward of the transposed weights.
        Case {
            opts: o.padding(1),
            ..case(2, 32, (6, 7), 16, (3, 3))
        },
        Case {
            bias: false,
            ..case(2, 16, (5, 9), 32, (1, 1))
        },
    ]
}

/// The direct convolution in f64 and its backward for output gradient `gy`, with the sum
/// of |terms| of every result (for the error bounds).
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

fn reference(c: &Case, x: &[f64], w: &[f64], b: Option<&[f64]>, gy: &[f64]) -> Reference {
    let (ho, wo) = c.out_hw();
    let o = &c.opts;
    let (cig, cog) = (c.c_in / o.groups, c.c_out / o.groups);
    let mut r = Reference {
        y: vec![0.0; c.n * c.c_out * ho * wo],
        y_abs: vec![0.0; c.n * c.c_out * ho * wo],
        dx: vec![0.0; x.len()],
        dx_abs: vec![0.0; x.len()],
        dw: vec![0.0; w.len()],
        dw_abs: vec![0.0; w.len()],
        db: vec![0.0; c.c_out],
        db_abs: vec![0.0; c.c_out],
    };
    for n in 0..c.n {
        for co in 0..c.c_out {
            for oh in 0..ho {
                for ow in 0..wo {
                    let yi = ((n * c.c_out + co) * ho + oh) * wo + ow;
                    let g = gy[yi];
                    if let Some(b) = b {
                        r.y[yi] += b[co];
                        r.y_abs[yi] += b[co].abs();
                    }
                    r.db[co] += g;
                    r.db_abs[co] += g.abs();
                    for ci in 0..cig {
                        let cx = (co / cog) * cig + ci;
                        for ki in 0..c.kh {
                            for kj in 0..c.kw {
                                let ih = (oh * o.stride.0 + ki * o.dilation.0) as isize
                                    - o.padding.0 as isize;
                                let iw = (ow * o.stride.1 + kj * o.dilation.1) as isize
                                    - o.padding.1 as isize;
                                if ih < 0 || iw < 0 || ih >= c.h as isize || iw >= c.w as isize {
                                    continue;
                                }
                                let xi =
                                    ((n * c.c_in + cx) * c.h + ih as usize) * c.w + iw as usize;
                                let wi = ((co * cig + ci) * c.kh + ki) * c.kw + kj;
                                r.y[yi] += x[xi] * w[wi];
                                r.y_abs[yi] += (x[xi] * w[wi]).abs();
                                r.dx[xi] += g * w[wi];
                                r.dx_abs[xi] += (g * w[wi]).abs();
                                r.dw[wi] += g * x[xi];
                                r.dw_abs[wi] += (g * x[xi]).abs();
                            }
                        }
                    }
                }
            }
        }
    }
    r
}

/// A random input, weight and bias for `c` (the input non-contiguous when `strided`).
struct Inputs {
    x: Tensor,
    xv: Vec<f64>,
    w: Tensor,
    wv: Vec<f64>,
    b: Option<Tensor>,
    bv: Option<Vec<f64>>,
}

fn inputs(c: &Case, dtypes: [DType; 3], strided: bool, rng: &mut Generator) -> Inputs {
    let (x, xv) = rand_tensor(&c.x_shape(), dtypes[0], strided, rng);
    let (w, wv) = rand_tensor(&c.w_shape(), dtypes[1], strided, rng);
    let (b, bv) = if c.bias {
        let (b, bv) = rand_tensor(&[c.c_out], dtypes[2], false, rng);
        (Some(b), Some(bv))
    } else {
        (None, None)
    };
    Inputs {
        x,
        xv,
        w,
        wv,
        b,
        bv,
    }
}

fn conv_forward(dtype: DType) {
    let mut rng = Generator::new(1);
    for (i, c) in cases().iter().enumerate() {
        let strided = i % 2 == 1;
        let t = inputs(c, [dtype; 3], strided, &mut rng);
        let y = t.x.conv2d(&t.w, t.b.as_ref(), c.opts).unwrap();
        assert_eq!(y.shape(), c.y_shape(), "{c:?}");
        assert_eq!(y.dtype(), dtype);
        let gy = vec![0.0; y.numel()];
        let r = reference(c, &t.xv, &t.wv, t.bv.as_deref(), &gy);
        let k = c.c_in / c.opts.groups * c.kh * c.kw + 1;
        assert_sums_close(
            &format!("{dtype} conv2d {c:?}"),
            &y.to_vec_f64(),
            &r.y,
            &r.y_abs,
            k,
            dtype,
        );
    }
}
dtype_tests!(conv_forward_matches_reference, super::conv_forward);

/// Gradients of input, weight and bias in the dtype against the reference backward: the
/// loss sum(y * gy) hands the convolution exactly `gy` as its output gradient.
fn conv_backward(dtype: DType) {
    let mut rng = Generator::new(2);
    for (i, c) in cases().iter().enumerate() {
        let t = inputs(c, [dtype; 3], i % 2 == 0, &mut rng);
        let (x, w) = (t.x.requires_grad_(), t.w.requires_grad_());
        let b = t.b.map(|b| b.requires_grad_());
        let y = x.conv2d(&w, b.as_ref(), c.opts).unwrap();
        let gyv = rand_values(y.numel(), -1.0, 1.0, dtype, &mut rng);
        let gy = Tensor::from_f64_vec(gyv.clone(), y.shape(), dtype).unwrap();
        y.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
        let r = reference(c, &t.xv, &t.wv, t.bv.as_deref(), &gyv);
        let (ho, wo) = c.out_hw();
        let what = |s: &str| format!("{dtype} conv2d {s} {c:?}");
        let grad = |t: &Tensor| {
            let g = t.grad().expect("gradient");
            assert_eq!(g.dtype(), dtype);
            assert_eq!(g.shape(), t.shape());
            g.to_vec_f64()
        };
        // dx: a GEMM over C_out/groups then col2im adding kh*kw of those partial sums.
        let dx_terms = (c.c_out / c.opts.groups + 1) * c.kh * c.kw;
        assert_sums_close(&what("dx"), &grad(&x), &r.dx, &r.dx_abs, dx_terms, dtype);
        // dw: per-image GEMMs over H_out*W_out, then one add per image.
        let dw_terms = c.n * (ho * wo + 1);
        assert_sums_close(&what("dw"), &grad(&w), &r.dw, &r.dw_abs, dw_terms, dtype);
        if let Some(b) = &b {
            let db_terms = c.n * (ho * wo + 1);
            assert_sums_close(&what("db"), &grad(b), &r.db, &r.db_abs, db_terms, dtype);
        }
    }
}
dtype_tests!(conv_backward_matches_reference, super::conv_backward);

/// An NHWC buffer seen as NCHW through `permute` (channels-last memory), as input and as
/// the output gradient's source.
fn conv_channels_last(dtype: DType) {
    let mut rng = Generator::new(3);
    let c = Case {
        opts: Conv2dOptions::default().padding(1).stride(2),
        ..case(2, 5, (9, 8), 6, (3, 3))
    };
    let nhwc = [c.n, c.h, c.w, c.c_in];
    let vals = rand_values(nhwc.iter().product(), -1.0, 1.0, dtype, &mut rng);
    let x = Tensor::from_f64_vec(vals.clone(), &nhwc, dtype)
        .unwrap()
        .permute(&[0, 3, 1, 2])
        .unwrap();
    assert!(!x.is_contiguous());
    // The same values in NCHW order for the reference.
    let mut xv = vec![0.0; vals.len()];
    for n in 0..c.n {
        for h in 0..c.h {
            for w in 0..c.w {
                for ch in 0..c.c_in {
                    xv[((n * c.c_in + ch) * c.h + h) * c.w + w] =
                        vals[((n * c.h + h) * c.w + w) * c.c_in + ch];
                }
            }
        }
    }
    let (w, wv) = rand_tensor(&c.w_shape(), dtype, false, &mut rng);
    let (b, bv) = rand_tensor(&[c.c_out], dtype, false, &mut rng);
    let y = x.conv2d(&w, Some(&b), c.opts).unwrap();
    let r = reference(&c, &xv, &wv, Some(&bv), &vec![0.0; y.numel()]);
    let k = c.c_in * c.kh * c.kw + 1;
    assert_sums_close(
        &format!("{dtype} channels-last conv2d"),
        &y.to_vec_f64(),
        &r.y,
        &r.y_abs,
        k,
        dtype,
    );
}
dtype_tests!(conv_channels_last_view, super::conv_channels_last);

/// Mixed dtypes promote (F16 with BF16 gives F32), and each gradient comes back in its
/// input's dtype.
#[test]
fn conv_mixed_dtypes_promote() {
    let mut rng = Generator::new(4);
    let c = Case {
        opts: Conv2dOptions::default().padding(1),
        ..case(2, 3, (6, 5), 4, (3, 3))
    };
    for dtypes in [
        [DType::F16, DType::F32, DType::F16],
        [DType::F16, DType::BF16, DType::BF16],
        [DType::BF16, DType::BF16, DType::F32],
    ] {
        let t = inputs(&c, dtypes, false, &mut rng);
        let (x, w) = (t.x.requires_grad_(), t.w.requires_grad_());
        let b = t.b.unwrap().requires_grad_();
        let y = x.conv2d(&w, Some(&b), c.opts).unwrap();
        assert_eq!(y.dtype(), DType::F32, "{dtypes:?}");
        let r = reference(&c, &t.xv, &t.wv, t.bv.as_deref(), &vec![0.0; y.numel()]);
        let k = c.c_in * c.kh * c.kw + 1;
        assert_sums_close("mixed", &y.to_vec_f64(), &r.y, &r.y_abs, k, DType::F32);
        y.sum_all().unwrap().backward().unwrap();
        for (t, d) in [(&x, dtypes[0]), (&w, dtypes[1]), (&b, dtypes[2])] {
            assert_eq!(t.grad().unwrap().dtype(), d, "{dtypes:?}");
        }
    }
}

/// Only the inputs that require grad get one (an input image usually does not).
#[test]
fn conv_grads_only_where_required() {
    let mut rng = Generator::new(5);
    let c = case(2, 3, (6, 5), 4, (3, 3));
    let t = inputs(&c, [DType::F32; 3], false, &mut rng);
    let w = t.w.requires_grad_();
    let y = t.x.conv2d(&w, t.b.as_ref(), c.opts).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert!(w.grad().is_some());
    assert!(t.x.grad().is_none());
    assert!(t.b.unwrap().grad().is_none());
}

/// The weight gradient sums per-thread partials in a fixed order: two runs agree bit for bit.
#[test]
fn conv_weight_grad_is_deterministic() {
    let mut rng = Generator::new(6);
    let c = Case {
        opts: Conv2dOptions::default().padding(1),
        ..case(7, 4, (9, 9), 8, (3, 3))
    };
    let t = inputs(&c, [DType::F32; 3], false, &mut rng);
    let run = || {
        let w = t.w.detach().requires_grad_();
        let y = t.x.conv2d(&w, None, c.opts).unwrap();
        y.square().unwrap().sum_all().unwrap().backward().unwrap();
        w.grad().unwrap().to_vec_f32()
    };
    let (a, b) = (run(), run());
    assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Analytic gradients of input, weight and bias against finite differences in F64, on
/// shapes small enough that each of the ~2·(numel) evaluations is cheap.
#[test]
fn conv_gradcheck() {
    let mut rng = Generator::new(7);
    let o = Conv2dOptions::default();
    let gc = [
        case(2, 2, (5, 4), 3, (3, 2)),
        Case {
            opts: o.stride(2).padding(1),
            ..case(2, 2, (5, 6), 2, (3, 3))
        },
        Case {
            opts: Conv2dOptions {
                stride: (1, 2),
                padding: (2, 1),
                dilation: (2, 1),
                groups: 2,
            },
            ..case(1, 4, (5, 5), 2, (2, 3))
        },
        Case {
            opts: o.groups(3).padding(1),
            bias: false,
            ..case(2, 3, (4, 4), 3, (3, 3))
        },
        case(2, 3, (3, 4), 2, (1, 1)),
    ];
    for c in gc {
        let mut ins = vec![
            grad_input(&c.x_shape(), &mut rng),
            grad_input(&c.w_shape(), &mut rng),
        ];
        if c.bias {
            ins.push(grad_input(&[c.c_out], &mut rng));
        }
        gradcheck(&format!("conv2d {c:?}"), &ins, |xs| {
            xs[0].conv2d(&xs[1], xs.get(2), c.opts)
        });
    }
}

/// CifarNet's feature extractor: the shapes that make fc1's input 128·6·6 = 4608.
#[test]
fn cifarnet_shapes() {
    let mut rng = Generator::new(8);
    let (x, _) = rand_tensor(&[2, 3, 32, 32], DType::F32, false, &mut rng);
    let (w1, _) = rand_tensor(&[64, 3, 3, 3], DType::F32, false, &mut rng);
    let (w2, _) = rand_tensor(&[128, 64, 3, 3], DType::F32, false, &mut rng);
    let o = Conv2dOptions::default();
    let y = x.conv2d(&w1, None, o).unwrap();
    assert_eq!(y.shape(), [2, 64, 30, 30]);
    let y = y
        .relu()
        .unwrap()
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .unwrap();
    assert_eq!(y.shape(), [2, 64, 15, 15]);
    let y = y.conv2d(&w2, None, o).unwrap();
    assert_eq!(y.shape(), [2, 128, 13, 13]);
    let y = y
        .relu()
        .unwrap()
        .max_pool2d((2, 2), (2, 2), (0, 0))
        .unwrap();
    assert_eq!(y.shape(), [2, 128, 6, 6]);
    assert_eq!(y.flatten(1, -1).unwrap().shape(), [2, 4608]);
}

#[test]
fn conv_errors() {
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32).unwrap();
    let o = Conv2dOptions::default();
    let x = z(&[2, 4, 8, 8]);
    let conv = |x: &Tensor, w: &Tensor, b: Option<&Tensor>, o| x.conv2d(w, b, o).unwrap_err();
    let is_shape = |e: Error| matches!(e, Error::Shape { op: "conv2d", .. });
    let is_arg = |e: Error| matches!(e, Error::Arg { op: "conv2d", .. });
    // Channel mismatch, with both shapes in the message.
    let e = conv(&x, &z(&[3, 5, 3, 3]), None, o);
    let msg = e.to_string();
    assert!(
        msg.contains("[2, 4, 8, 8]") && msg.contains("[3, 5, 3, 3]"),
        "{msg}"
    );
    assert!(is_shape(e));
    // Groups that do not divide the channels, and zero groups.
    assert!(is_arg(conv(&x, &z(&[3, 2, 3, 3]), None, o.groups(2))));
    assert!(is_arg(conv(&x, &z(&[4, 4, 3, 3]), None, o.groups(3))));
    assert!(is_arg(conv(&x, &z(&[4, 4, 3, 3]), None, o.groups(0))));
    // Kernel larger than the padded input (plain and dilated).
    assert!(is_shape(conv(&x, &z(&[2, 4, 9, 3]), None, o)));
    assert!(is_shape(conv(&x, &z(&[2, 4, 3, 3]), None, o.dilation(4))));
    assert!(x.conv2d(&z(&[2, 4, 9, 3]), None, o.padding(1)).is_ok());
    // Zero stride or dilation.
    assert!(is_arg(conv(&x, &z(&[2, 4, 3, 3]), None, o.stride(0))));
    assert!(is_arg(conv(&x, &z(&[2, 4, 3, 3]), None, o.dilation(0))));
    // Wrong ranks.
    assert!(is_shape(conv(&z(&[4, 8, 8]), &z(&[2, 4, 3, 3]), None, o)));
    assert!(is_shape(conv(&x, &z(&[2, 36]), None, o)));
    // Bias of the wrong shape.
    assert!(is_shape(conv(&x, &z(&[2, 4, 3, 3]), Some(&z(&[3])), o)));
    // Integer tensors.
    let xi = Tensor::from_vec(vec![0i64; 2 * 4 * 8 * 8], &[2, 4, 8, 8]).unwrap();
    assert!(matches!(
        conv(&xi, &z(&[2, 4, 3, 3]), None, o),
        Error::DType { op: "conv2d", .. }
    ));
    // An empty batch is fine.
    let y = z(&[0, 4, 8, 8]).conv2d(&z(&[2, 4, 3, 3]), None, o).unwrap();
    assert_eq!(y.shape(), [0, 2, 6, 6]);
}
