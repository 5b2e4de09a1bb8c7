//! The CPU's fused kernels held to their default compositions (`backend::compose`, the
//! default bodies a backend with only the basic primitives runs): the same inputs through
//! the CPU override and through the composition of the CPU's basic primitives, on F32, F16
//! and BF16, odd sizes and strided views. The composition rounds between its parts where
//! the fused kernel rounds once, so the two agree to a rounding or two of the dtype (the
//! `permissive` tolerance of a chain of half ops); a wrong mask, index, channel or missing
//! term errs by O(1).

use crate::common::{assert_close, permissive, rand_values, tensor};
use hemi::backend::compose;
use hemi::backend::nn::{
    Act, ActSaved, Affine, BatchNormGeom, BatchNormMode, BlockGrads, Conv2dGeom, Grads, NnOps,
    Saved,
};
use hemi::cpu::storage::CpuStorage;
use hemi::rng::Generator;
use hemi::tensor::{Layout, Tensor};
use hemi::DType;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// A tensor's buffer on the host and its layout.
fn parts(t: &Tensor) -> (CpuStorage, Layout) {
    (
        t.storage().to_cpu().unwrap().into_owned(),
        t.layout().clone(),
    )
}

/// The values of a contiguous result of `shape`.
fn values(s: &CpuStorage, shape: &[usize]) -> Vec<f64> {
    Tensor::from_storage_layout(s.clone(), Layout::contiguous(shape))
        .unwrap()
        .to_vec_f64()
}

fn close(what: &str, got: &CpuStorage, want: &CpuStorage, shape: &[usize], dtype: DType) {
    assert_close(
        what,
        &values(got, shape),
        &values(want, shape),
        permissive(dtype),
    );
}

fn close_grads(
    what: &str,
    got: &Grads<CpuStorage>,
    want: &Grads<CpuStorage>,
    shapes: [&[usize]; 3],
    dtype: DType,
) {
    let pairs = [
        ("dx", &got.dx, &want.dx, shapes[0]),
        ("dweight", &got.dweight, &want.dweight, shapes[1]),
        ("dbias", &got.dbias, &want.dbias, shapes[2]),
    ];
    for (name, g, w, shape) in pairs {
        match (g, w) {
            (Some(g), Some(w)) => close(&format!("{what} {name}"), g, w, shape, dtype),
            (None, None) => {}
            _ => panic!("{what} {name}: one side has it, the other not"),
        }
    }
}

fn rand(shape: &[usize], dtype: DType, strided: bool, rng: &mut Generator) -> Tensor {
    let n = shape.iter().product();
    tensor(
        &rand_values(n, -2.0, 2.0, dtype, rng),
        shape,
        dtype,
        strided,
    )
}

#[test]
fn batch_norm_act_matches_its_composition_forward_backward_and_apply() {
    let mut rng = Generator::new(7);
    let shape = [3, 5, 7, 3];
    let g = BatchNormGeom { n: 3, c: 5, s: 21 };
    for dtype in DTYPES {
        for (residual, relu, strided) in [
            (true, true, false),
            (false, true, true),
            (true, false, true),
        ] {
            let what = format!("{dtype:?} residual {residual} relu {relu} strided {strided}");
            let (x, lx) = parts(&rand(&shape, dtype, strided, &mut rng));
            let (r, lr) = parts(&rand(&shape, dtype, !strided, &mut rng));
            let (w, lw) = parts(&rand(&[5], DType::F32, false, &mut rng));
            let (b, lb) = parts(&rand(&[5], DType::F32, false, &mut rng));
            let (rm, lrm) = parts(&rand(&[5], DType::F32, false, &mut rng));
            let (rv, lrv) = parts(&tensor(
                &[0.5, 1.0, 1.5, 2.0, 0.25],
                &[5],
                DType::F32,
                false,
            ));
            let res = residual.then_some((&r, &lr));
            let running = Some(((&rm, &lrm), (&rv, &lrv)));
            let (wo, bo) = (Some((&w, &lw)), Some((&b, &lb)));
            let mode = BatchNormMode {
                training: true,
                momentum: 0.1,
                eps: 1e-5,
            };
            let act = || Act {
                residual: res,
                relu,
            };
            let aff = Affine {
                weight: wo,
                bias: bo,
            };
            let fused = NnOps::batch_norm_act(&x, &lx, g, act(), aff, running, mode).unwrap();
            let composed = compose::batch_norm_act(&x, &lx, g, act(), aff, running, mode).unwrap();
            close(
                &format!("{what}: out"),
                &fused.out,
                &composed.out,
                &shape,
                dtype,
            );
            close(
                &format!("{what}: mean"),
                &fused.mean,
                &composed.mean,
                &[5],
                DType::F32,
            );
            close(
                &format!("{what}: invstd"),
                &fused.invstd,
                &composed.invstd,
                &[5],
                DType::F32,
            );
            let ((fm, fv), (cm, cv)) = (fused.running.unwrap(), composed.running.unwrap());
            close(&format!("{what}: running mean"), &fm, &cm, &[5], DType::F32);
            close(&format!("{what}: running var"), &fv, &cv, &[5], DType::F32);

            // The backward from the same upstream gradient and the fused forward's output.
            let (dy, ldy) = parts(&rand(&shape, dtype, strided, &mut rng));
            let ly = Layout::contiguous(&shape);
            let y = relu.then_some((&fused.out, &ly));
            let dtypes = (Some(dtype), Some(DType::F32), Some(DType::F32));
            let (mean, invstd) = (&fused.mean, &fused.invstd);
            let act = || ActSaved {
                y,
                want_residual: residual,
            };
            let saved = || Saved {
                mean,
                invstd,
                weight: wo,
                from_input: true,
            };
            let (fg, fr) =
                NnOps::batch_norm_act_backward(&dy, &ldy, act(), (&x, &lx), g, saved(), dtypes)
                    .unwrap();
            let (cg, cr) =
                compose::batch_norm_act_backward(&dy, &ldy, act(), (&x, &lx), g, saved(), dtypes)
                    .unwrap();
            close_grads(&what, &fg, &cg, [&shape, &[5], &[5]], dtype);
            assert_eq!(fr.is_some(), residual, "{what}: residual gradient");
            if let (Some(f), Some(c)) = (fr, cr) {
                close(&format!("{what}: residual gradient"), &f, &c, &shape, dtype);
            }

            // Applying the forward's statistics again.
            let fa = NnOps::batch_norm_act_apply(&x, &lx, g, (mean, invstd), aff, relu).unwrap();
            let ca = compose::batch_norm_act_apply(&x, &lx, g, (mean, invstd), aff, relu).unwrap();
            close(&format!("{what}: apply"), &fa, &ca, &shape, dtype);
        }
    }
}

#[test]
fn conv2d_relu_max_pool2_matches_its_composition_forward_and_backward() {
    let mut rng = Generator::new(11);
    for dtype in DTYPES {
        for (h, w, pad, bias, strided) in [(9, 7, 1, true, false), (6, 11, 0, false, true)] {
            let what = format!("{dtype:?} {h}x{w} pad {pad} bias {bias} strided {strided}");
            let (n, c_in, c_out, k) = (2, 3, 4, 3);
            let h_out = h + 2 * pad - k + 1;
            let w_out = w + 2 * pad - k + 1;
            let g = Conv2dGeom {
                n,
                c_in,
                h,
                w,
                c_out,
                kh: k,
                kw: k,
                stride: (1, 1),
                padding: (pad, pad),
                dilation: (1, 1),
                groups: 1,
                h_out,
                w_out,
            };
            let (x, lx) = parts(&rand(&g.in_shape(), dtype, strided, &mut rng));
            let (wt, lw) = parts(&rand(&g.weight_shape(), dtype, false, &mut rng));
            let (b, lb) = parts(&rand(&[c_out], dtype, false, &mut rng));
            let bo = bias.then_some((&b, &lb));
            let (fo, fi) = NnOps::conv2d_relu_max_pool2(&x, &lx, &wt, &lw, bo, &g).unwrap();
            let (co, ci) = compose::conv2d_relu_max_pool2(&x, &lx, &wt, &lw, bo, &g).unwrap();
            let pooled = g.pooled_shape();
            close(&format!("{what}: out"), &fo, &co, &pooled, dtype);

            let (dy, ldy) = parts(&rand(&pooled, dtype, false, &mut rng));
            let want = BlockGrads { dx: true, bias };
            let fg = NnOps::conv2d_relu_max_pool2_backward(
                &dy,
                &ldy,
                &fi,
                (&x, &lx),
                (&wt, &lw),
                &g,
                want,
            )
            .unwrap();
            let cg = compose::conv2d_relu_max_pool2_backward(
                &dy,
                &ldy,
                &ci,
                (&x, &lx),
                (&wt, &lw),
                &g,
                want,
            )
            .unwrap();
            close_grads(
                &what,
                &fg,
                &cg,
                [&g.in_shape(), &g.weight_shape(), &[c_out]],
                dtype,
            );
        }
    }
}

#[test]
fn a_composed_backward_refuses_another_backends_indices() {
    let mut rng = Generator::new(3);
    let g = Conv2dGeom {
        n: 1,
        c_in: 1,
        h: 4,
        w: 4,
        c_out: 1,
        kh: 1,
        kw: 1,
        stride: (1, 1),
        padding: (0, 0),
        dilation: (1, 1),
        groups: 1,
        h_out: 4,
        w_out: 4,
    };
    let (x, lx) = parts(&rand(&g.in_shape(), DType::F32, false, &mut rng));
    let (wt, lw) = parts(&rand(&g.weight_shape(), DType::F32, false, &mut rng));
    // The CPU's fused forward keeps its own indices; the composition cannot read them.
    let (_, fused) = NnOps::conv2d_relu_max_pool2(&x, &lx, &wt, &lw, None, &g).unwrap();
    let (dy, ldy) = parts(&rand(&g.pooled_shape(), DType::F32, false, &mut rng));
    let want = BlockGrads {
        dx: true,
        bias: false,
    };
    let err =
        compose::conv2d_relu_max_pool2_backward(&dy, &ldy, &fused, (&x, &lx), (&wt, &lw), &g, want)
            .unwrap_err()
            .to_string();
    assert!(err.contains("not from this backend's forward"), "{err}");
}

#[test]
fn softmax_matches_its_composition_forward_and_backward() {
    use hemi::backend::reduce::{ReduceOps, Rows};
    let mut rng = Generator::new(13);
    let shape = [3, 7, 5];
    for dtype in DTYPES {
        // Along the middle dim (inner 5) and along the last (inner 1), strided or not.
        for (dim, strided) in [(1, true), (2, false), (0, true)] {
            let (_, rows) = Rows::along("softmax", &shape, dim).unwrap();
            for log in [false, true] {
                let what = format!("{dtype:?} dim {dim} log {log} strided {strided}");
                let (x, lx) = parts(&rand(&shape, dtype, strided, &mut rng));
                let f = ReduceOps::softmax(&x, &lx, rows, log, dtype).unwrap();
                let c = compose::softmax(&x, &lx, rows, log, dtype).unwrap();
                close(&format!("{what}: out"), &f, &c, &shape, dtype);
                let (g, lg) = parts(&rand(&shape, dtype, !strided, &mut rng));
                let ly = Layout::contiguous(&shape);
                let fb = ReduceOps::softmax_backward(&g, &lg, &f, &ly, rows, log, dtype).unwrap();
                let cb = compose::softmax_backward(&g, &lg, &f, &ly, rows, log, dtype).unwrap();
                close(&format!("{what}: grad"), &fb, &cb, &shape, dtype);
            }
        }
    }
}

#[test]
fn layer_norm_matches_its_composition_forward_and_backward() {
    let mut rng = Generator::new(17);
    let (shape, d) = ([4, 3, 19], 19);
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let c = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for (affine, strided) in [(true, false), (false, true), (true, true)] {
            let what = format!("{dtype:?} affine {affine} strided {strided}");
            let (x, lx) = parts(&rand(&shape, dtype, strided, &mut rng));
            let (w, lw) = parts(&rand(&[d], dtype, false, &mut rng));
            let (b, lb) = parts(&rand(&[d], dtype, false, &mut rng));
            let (wo, bo) = (affine.then_some((&w, &lw)), affine.then_some((&b, &lb)));
            let aff = Affine {
                weight: wo,
                bias: bo,
            };
            let f = NnOps::layer_norm(&x, &lx, d, aff, 1e-5).unwrap();
            let k = compose::layer_norm(&x, &lx, d, aff, 1e-5).unwrap();
            close(&format!("{what}: out"), &f.out, &k.out, &shape, dtype);
            close(&format!("{what}: mean"), &f.mean, &k.mean, &[12], c);
            close(&format!("{what}: rstd"), &f.rstd, &k.rstd, &[12], c);

            let (dy, ldy) = parts(&rand(&shape, dtype, !strided, &mut rng));
            let dtypes = (
                Some(dtype),
                affine.then_some(dtype),
                affine.then_some(dtype),
            );
            let (mean, rstd) = (&f.mean, &f.rstd);
            let saved = || Saved {
                mean,
                invstd: rstd,
                weight: wo,
                from_input: true,
            };
            let fg = NnOps::layer_norm_backward(&dy, &ldy, (&x, &lx), d, saved(), dtypes).unwrap();
            let kg =
                compose::layer_norm_backward(&dy, &ldy, (&x, &lx), d, saved(), dtypes).unwrap();
            close_grads(&what, &fg, &kg, [&shape, &[d], &[d]], dtype);
        }
    }
}

#[test]
fn conv2d_bias_gradient_matches_its_composition() {
    let mut rng = Generator::new(19);
    for dtype in DTYPES {
        let g = Conv2dGeom {
            n: 3,
            c_in: 2,
            h: 7,
            w: 5,
            c_out: 5,
            kh: 3,
            kw: 3,
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
            h_out: 5,
            w_out: 3,
        };
        for strided in [false, true] {
            let (dy, ldy) = parts(&rand(&g.out_shape(), dtype, strided, &mut rng));
            let f = NnOps::conv2d_backward_bias(&dy, &ldy, &g, DType::F32).unwrap();
            let c = compose::conv2d_backward_bias(&dy, &ldy, &g, DType::F32).unwrap();
            close(
                &format!("{dtype:?} strided {strided}"),
                &f,
                &c,
                &[5],
                DType::F32,
            );
        }
    }
}

#[test]
fn batch_norm_matches_its_composition_in_training_and_eval() {
    let mut rng = Generator::new(23);
    let shape = [3, 4, 5, 3];
    let g = BatchNormGeom { n: 3, c: 4, s: 15 };
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let c = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for (training, affine, strided) in [
            (true, true, true),
            (true, false, false),
            (false, true, false),
        ] {
            let what = format!("{dtype:?} training {training} affine {affine} strided {strided}");
            let (x, lx) = parts(&rand(&shape, dtype, strided, &mut rng));
            let (w, lw) = parts(&rand(&[4], c, false, &mut rng));
            let (b, lb) = parts(&rand(&[4], c, false, &mut rng));
            let (rm, lrm) = parts(&rand(&[4], c, false, &mut rng));
            let (rv, lrv) = parts(&tensor(&[0.5, 1.0, 1.5, 2.0], &[4], c, false));
            let (wo, bo) = (affine.then_some((&w, &lw)), affine.then_some((&b, &lb)));
            let running = Some(((&rm, &lrm), (&rv, &lrv)));
            let mode = BatchNormMode {
                training,
                momentum: 0.1,
                eps: 1e-5,
            };
            let aff = Affine {
                weight: wo,
                bias: bo,
            };
            let f = NnOps::batch_norm(&x, &lx, g, aff, running, mode).unwrap();
            let k = compose::batch_norm(&x, &lx, g, aff, running, mode).unwrap();
            close(&format!("{what}: out"), &f.out, &k.out, &shape, dtype);
            close(&format!("{what}: mean"), &f.mean, &k.mean, &[4], c);
            close(&format!("{what}: invstd"), &f.invstd, &k.invstd, &[4], c);
            assert_eq!(f.running.is_some(), training, "{what}: running update");
            if let (Some((fm, fv)), Some((km, kv))) = (f.running, k.running) {
                close(&format!("{what}: running mean"), &fm, &km, &[4], c);
                close(&format!("{what}: running var"), &fv, &kv, &[4], c);
            }

            let (dy, ldy) = parts(&rand(&shape, dtype, !strided, &mut rng));
            let dtypes = (Some(dtype), affine.then_some(c), affine.then_some(c));
            let (mean, invstd) = (&f.mean, &f.invstd);
            let saved = || Saved {
                mean,
                invstd,
                weight: wo,
                from_input: training,
            };
            let fg = NnOps::batch_norm_backward(&dy, &ldy, (&x, &lx), g, saved(), dtypes).unwrap();
            let kg =
                compose::batch_norm_backward(&dy, &ldy, (&x, &lx), g, saved(), dtypes).unwrap();
            close_grads(&what, &fg, &kg, [&shape, &[4], &[4]], dtype);
        }
    }
}

#[test]
fn variance_gradient_matches_its_composition() {
    use hemi::backend::reduce::ReduceOps;
    let mut rng = Generator::new(29);
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        for correction in [0, 1] {
            // Rows reduced as stored ([5, 9], inner 9), and columns through a transposed
            // view ([9, 5] over a [5, 9] buffer: not contiguous, inner 5).
            let x = rand(&[5, 9], dtype, false, &mut rng);
            let (xs, lrow) = parts(&x);
            let lcol = Layout::new(vec![9, 5], vec![1, 9], lrow.offset());
            for (l, outer, inner) in [(lrow.clone(), 5, 9), (lcol, 9, 5)] {
                let what = format!("{dtype:?} correction {correction} outer {outer}");
                let (g, lg) = parts(&rand(&[outer], dtype, false, &mut rng));
                let runs = (outer, inner);
                let f =
                    ReduceOps::var_backward(&xs, &l, (&g, &lg), runs, correction, dtype).unwrap();
                let k = compose::var_backward(&xs, &l, (&g, &lg), runs, correction, dtype).unwrap();
                close(&what, &f, &k, &[outer, inner], dtype);
            }
        }
    }
}

#[test]
fn mse_matches_its_composition_forward_and_backward() {
    use hemi::backend::loss::{LossOps, Reduction};
    let mut rng = Generator::new(31);
    let shape = [7, 5];
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let c = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            let what = format!("{dtype:?} {reduction:?}");
            let (a, la) = parts(&rand(&shape, dtype, true, &mut rng));
            let (b, lb) = parts(&rand(&shape, dtype, false, &mut rng));
            let (fl, fd) = LossOps::mse(&a, &la, &b, &lb, reduction, c).unwrap();
            let (kl, kd) = compose::mse(&a, &la, &b, &lb, reduction, c).unwrap();
            let loss_shape: &[usize] = if reduction == Reduction::None {
                &shape
            } else {
                &[1]
            };
            close(&format!("{what}: loss"), &fl, &kl, loss_shape, c);
            close(&format!("{what}: diff"), &fd, &kd, &shape, c);
            let (g, lg) = parts(&rand(loss_shape, c, false, &mut rng));
            let (fa, fb) = LossOps::mse_backward(&fd, &g, &lg, reduction, c).unwrap();
            let (ka, kb) = compose::mse_backward(&fd, &g, &lg, reduction, c).unwrap();
            close(&format!("{what}: d input"), &fa, &ka, &shape, c);
            close(&format!("{what}: d target"), &fb, &kb, &shape, c);
        }
    }
}

#[test]
fn where_backward_and_unscale_check_match_their_compositions() {
    use hemi::backend::map::MapOps;
    use hemi::backend::train::AmpOps;
    let mut rng = Generator::new(37);
    let shape = [6, 7];
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        // A condition with zeros (false), NaN (true) and other values, broadcast along rows.
        let mut cv = rand_values(7, -1.0, 1.0, DType::F32, &mut rng);
        cv[1] = 0.0;
        cv[4] = f64::NAN;
        cv[5] = 0.0;
        let (cond, lc0) = parts(&tensor(&cv, &[7], DType::F32, false));
        let lc = Layout::new(vec![6, 7], vec![0, 1], lc0.offset());
        let (g, lg) = parts(&rand(&shape, dtype, true, &mut rng));
        let (fa, fb) = MapOps::where_backward(&cond, &lc, &g, &lg, dtype).unwrap();
        let (ka, kb) = compose::where_backward(&cond, &lc, &g, &lg, dtype).unwrap();
        // Selections are exact: the same bits.
        assert_eq!(
            values(&fa, &shape),
            values(&ka, &shape),
            "{dtype:?}: where true side"
        );
        assert_eq!(
            values(&fb, &shape),
            values(&kb, &shape),
            "{dtype:?}: where false side"
        );

        for poison in [None, Some(f64::INFINITY), Some(f64::NAN)] {
            let mut gv = rand_values(42, -3.0, 3.0, dtype, &mut rng);
            if let Some(p) = poison {
                gv[17] = p;
            }
            let (g, lg) = parts(&tensor(&gv, &shape, dtype, true));
            let flag = || CpuStorage::from_vec(vec![0.0f32]);
            let (mut ff, mut kf) = (flag(), flag());
            let fy = AmpOps::unscale_check(&g, &lg, 0.125, &mut ff).unwrap();
            let ky = compose::unscale_check(&g, &lg, 0.125, &mut kf).unwrap();
            let what = format!("{dtype:?} poison {poison:?}");
            let (fv, kv) = (values(&fy, &shape), values(&ky, &shape));
            assert_eq!(fv.len(), kv.len(), "{what}");
            for (a, b) in fv.iter().zip(&kv) {
                assert!(a == b || (a.is_nan() && b.is_nan()), "{what}: {a} vs {b}");
            }
            let flags = (values(&ff, &[1])[0], values(&kf, &[1])[0]);
            assert_eq!(flags.0, flags.1, "{what}: found_inf");
            assert_eq!(flags.0, if poison.is_some() { 1.0 } else { 0.0 }, "{what}");
        }
    }
    // A flag of the wrong shape is an error on both.
    let (g, lg) = parts(&rand(&shape, DType::F32, false, &mut rng));
    let mut bad = CpuStorage::from_vec(vec![0.0f32, 0.0]);
    assert!(compose::unscale_check(&g, &lg, 1.0, &mut bad).is_err());
}

#[test]
fn gradient_statistics_on_the_host_match_the_cpus() {
    use hemi::backend::train::AmpOps;
    let mut rng = Generator::new(41);
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let mut v = rand_values(63, -1e-3, 1e-3, dtype, &mut rng);
        v[3] = 0.0;
        v[9] = 7e4;
        v[20] = f64::NAN;
        let (x, lx) = parts(&tensor(&v, &[7, 9], dtype, true));
        for p in [1.0, 2.0, 3.0, f64::INFINITY] {
            let (a, b) = (
                AmpOps::norm_partial(&x, &lx, p).unwrap(),
                compose::norm_partial(&x, &lx, p).unwrap(),
            );
            assert!(
                a == b || (a.is_nan() && b.is_nan()),
                "{dtype:?} p {p}: {a} vs {b}"
            );
        }
        assert_eq!(
            AmpOps::range_counts(&x, &lx, 6e-5, 65504.0).unwrap(),
            compose::range_counts(&x, &lx, 6e-5, 65504.0).unwrap(),
            "{dtype:?}"
        );
        assert_eq!(
            AmpOps::log2_histogram(&x, &lx).unwrap(),
            compose::log2_histogram(&x, &lx).unwrap(),
            "{dtype:?}"
        );
    }
}
