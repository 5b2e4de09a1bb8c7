//! The CPU's pools, class losses, attention and optimizer steps held to their default
//! compositions (`backend::compose::{pool, loss, attention, optim}`): the primitives a new
//! backend no longer writes. As in `compose.rs`, the same inputs (odd sizes, strided
//! views, F32/F16/BF16) go through the CPU override and through the composition of the
//! CPU's basic primitives; they agree to a rounding or two of the dtype (`permissive`),
//! while a wrong window, divisor, target, mask, dropout factor or term errs by O(1).

use crate::common::{assert_close, permissive, rand_values, tensor};
use hemi::backend::compose;
use hemi::backend::loss::{ClassLoss, ClassSaved, LossOps, Reduction};
use hemi::backend::nn::{AdaptivePool2dGeom, AttentionGeom, NnOps, Pool2dGeom, Qkv};
use hemi::backend::reduce::Rows;
use hemi::backend::train::{AdamDecay, AdamScalars, AdamState, OptimOps, SgdFlags, SgdScalars};
use hemi::cpu::storage::CpuStorage;
use hemi::rng::Generator;
use hemi::tensor::{Layout, Tensor};
use hemi::{DType, Error};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn parts(t: &Tensor) -> (CpuStorage, Layout) {
    (
        t.storage().to_cpu().unwrap().into_owned(),
        t.layout().clone(),
    )
}

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

fn rand(shape: &[usize], dtype: DType, strided: bool, rng: &mut Generator) -> Tensor {
    let n = shape.iter().product();
    tensor(
        &rand_values(n, -2.0, 2.0, dtype, rng),
        shape,
        dtype,
        strided,
    )
}

fn pool_geom(planes: usize, (h, w): (usize, usize), k: usize, s: usize, p: usize) -> Pool2dGeom {
    Pool2dGeom {
        planes,
        h,
        w,
        kernel: (k, k),
        stride: (s, s),
        padding: (p, p),
        h_out: (h + 2 * p - k) / s + 1,
        w_out: (w + 2 * p - k) / s + 1,
    }
}

#[test]
fn average_pools_match_their_compositions_forward_and_backward() {
    let mut rng = Generator::new(41);
    for dtype in DTYPES {
        // Odd planes, overlapping and padded windows, a window wider than the stride.
        for (hw, k, s, p, strided) in [
            ((7, 9), 3, 2, 1, true),
            ((6, 5), 2, 2, 0, false),
            ((5, 8), 3, 1, 1, true),
        ] {
            let g = pool_geom(2 * 3, hw, k, s, p);
            let shape = [2, 3, hw.0, hw.1];
            let out_shape = [2, 3, g.h_out, g.w_out];
            let (x, lx) = parts(&rand(&shape, dtype, strided, &mut rng));
            let (dy, ldy) = parts(&rand(&out_shape, dtype, !strided, &mut rng));
            for include_pad in [true, false] {
                let what = format!("{dtype:?} {hw:?} k{k} s{s} p{p} include_pad {include_pad}");
                let f = NnOps::avg_pool2d(&x, &lx, &g, include_pad).unwrap();
                let c = compose::pool::avg_pool2d(&x, &lx, &g, include_pad).unwrap();
                close(&format!("{what}: out"), &c, &f, &out_shape, dtype);
                let fb = NnOps::avg_pool2d_backward(&dy, &ldy, &g, include_pad, dtype).unwrap();
                let cb =
                    compose::pool::avg_pool2d_backward(&dy, &ldy, &g, include_pad, dtype).unwrap();
                close(&format!("{what}: grad"), &cb, &fb, &shape, dtype);
            }
        }
        // Adaptive: uneven, overlapping bins; a global pool; more outputs than inputs.
        for ((h, w), (ho, wo)) in [((7, 9), (3, 4)), ((5, 5), (1, 1)), ((3, 2), (5, 3))] {
            let g = AdaptivePool2dGeom {
                planes: 5,
                h,
                w,
                h_out: ho,
                w_out: wo,
            };
            let what = format!("{dtype:?} adaptive {h}x{w} -> {ho}x{wo}");
            let (shape, out_shape) = ([5, h, w], [5, ho, wo]);
            let (x, lx) = parts(&rand(&shape, dtype, true, &mut rng));
            let f = NnOps::adaptive_avg_pool2d(&x, &lx, &g).unwrap();
            let c = compose::pool::adaptive_avg_pool2d(&x, &lx, &g).unwrap();
            close(&format!("{what}: out"), &c, &f, &out_shape, dtype);
            let (dy, ldy) = parts(&rand(&out_shape, dtype, false, &mut rng));
            let fb = NnOps::adaptive_avg_pool2d_backward(&dy, &ldy, &g, dtype).unwrap();
            let cb = compose::pool::adaptive_avg_pool2d_backward(&dy, &ldy, &g, dtype).unwrap();
            close(&format!("{what}: grad"), &cb, &fb, &shape, dtype);
        }
    }
}

#[test]
fn class_losses_match_their_compositions_forward_and_backward() {
    let mut rng = Generator::new(43);
    // [rows, classes] (the class dim last) and [n, classes, positions] (class dim in the
    // middle, as a segmentation loss).
    for (shape, dim) in [(vec![6usize, 5], 1isize), (vec![3, 4, 5], 1)] {
        let (_, rows) = Rows::along("cross_entropy", &shape, dim).unwrap();
        let n = rows.count();
        for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let c = dtype.compute_type();
            for (from_logits, smoothing, ignore) in [
                (true, 0.0, None),
                (true, 0.1, Some(-100)),
                (false, 0.0, Some(2)),
                (false, 0.25, None),
            ] {
                let mut t: Vec<i64> = (0..n).map(|i| (i * 7 % rows.len) as i64).collect();
                if let Some(ig) = ignore {
                    t[1] = ig;
                    t[n - 1] = ig;
                }
                let target = CpuStorage::from_vec(t.clone());
                let lt = Layout::contiguous(&[n]);
                let x = if from_logits {
                    rand(&shape, dtype, true, &mut rng)
                } else {
                    rand(&shape, dtype, true, &mut rng)
                        .log_softmax(dim)
                        .unwrap()
                };
                let (x, lx) = parts(&x);
                for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                    let loss = ClassLoss {
                        op: "cross_entropy",
                        from_logits,
                        reduction,
                        ignore_index: ignore,
                        label_smoothing: smoothing,
                    };
                    let what = format!(
                        "{dtype:?} {shape:?} logits {from_logits} ε {smoothing} ignore {ignore:?} {reduction:?}"
                    );
                    let f = LossOps::class_loss(&x, &lx, &target, &lt, rows, loss, c).unwrap();
                    let k =
                        compose::loss::class_loss(&x, &lx, &target, &lt, rows, loss, c).unwrap();
                    assert_eq!(f.counted, k.counted, "{what}: counted");
                    let lshape: &[usize] = if reduction == Reduction::None {
                        &[n]
                    } else {
                        &[1]
                    };
                    close(&format!("{what}: loss"), &k.loss, &f.loss, lshape, c);
                    match (&f.log_probs, &k.log_probs) {
                        (Some(a), Some(b)) => close(&format!("{what}: lp"), b, a, &shape, c),
                        (None, None) => {}
                        _ => panic!("{what}: log_probs on one side only"),
                    }
                    let (g, lg) = parts(&rand(lshape, c, false, &mut rng));
                    let lp = f.log_probs.as_ref();
                    let saved = || ClassSaved {
                        log_probs: lp,
                        counted: f.counted,
                    };
                    let t = (&target, &lt);
                    let fb =
                        LossOps::class_loss_backward(&g, &lg, saved(), t, rows, loss, c).unwrap();
                    let kb = compose::loss::class_loss_backward(&g, &lg, saved(), t, rows, loss, c)
                        .unwrap();
                    close(&format!("{what}: grad"), &kb, &fb, &shape, c);
                }
            }
        }
    }
    // A target outside the classes is the same index error on both.
    let (x, lx) = parts(&rand(&[2, 3], DType::F32, false, &mut rng));
    let target = CpuStorage::from_vec(vec![1i64, 3]);
    let loss = ClassLoss {
        op: "cross_entropy",
        from_logits: true,
        reduction: Reduction::Mean,
        ignore_index: None,
        label_smoothing: 0.0,
    };
    let rows = Rows {
        outer: 2,
        len: 3,
        inner: 1,
    };
    let lt = Layout::contiguous(&[2]);
    let k = compose::loss::class_loss(&x, &lx, &target, &lt, rows, loss, DType::F32);
    assert!(
        matches!(
            k,
            Err(Error::Index {
                index: 3,
                size: 3,
                ..
            })
        ),
        "{k:?}"
    );
}

/// `[b, h, l, d]` as the permuted view of a `[b, l, h, d]` buffer (a projection's heads).
fn heads(b: usize, h: usize, l: usize, d: usize, dtype: DType, rng: &mut Generator) -> Tensor {
    let v = rand_values(b * l * h * d, -1.5, 1.5, dtype, rng);
    Tensor::from_f64_vec(v, &[b, l, h, d], dtype)
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap()
}

#[test]
fn attention_matches_its_composition_forward_and_backward() {
    let mut rng = Generator::new(47);
    let (b, h, lq, lk, d, dv) = (2, 3, 5, 7, 4, 6);
    for dtype in DTYPES {
        let c = dtype.compute_type();
        for (masked, dropout, fully_masked_row) in [
            (false, None, false),
            (true, Some((0.3, 99u64)), false),
            (true, None, true),
        ] {
            let what =
                format!("{dtype:?} mask {masked} dropout {dropout:?} full {fully_masked_row}");
            let (q, lqv) = parts(&heads(b, h, lq, d, dtype, &mut rng));
            let (k, lkv) = parts(&heads(b, h, lk, d, dtype, &mut rng));
            let (v, lvv) = parts(&heads(b, h, lk, dv, dtype, &mut rng));
            // An additive key-padding mask [b, 1, 1, lk] broadcast over heads and queries,
            // or (fully masked) a [b, 1, lq, lk] one with one row all -inf.
            let mask = masked.then(|| {
                if fully_masked_row {
                    let mut m = vec![0.0; b * lq * lk];
                    m[lq * lk + 2 * lk..lq * lk + 3 * lk].fill(f64::NEG_INFINITY);
                    m[3] = f64::NEG_INFINITY;
                    let t = Tensor::from_f64_vec(m, &[b, 1, lq, lk], c).unwrap();
                    parts(&t.broadcast_to(&[b, h, lq, lk]).unwrap())
                } else {
                    let m: Vec<f64> = (0..b * lk)
                        .map(|i| if i % lk >= lk - 2 + i / lk { -1e4 } else { 0.0 })
                        .collect();
                    let t = Tensor::from_f64_vec(m, &[b, 1, 1, lk], c).unwrap();
                    parts(&t.broadcast_to(&[b, h, lq, lk]).unwrap())
                }
            });
            let mask_ref = mask.as_ref().map(|(m, l)| (m, l));
            let g = AttentionGeom {
                batch: b * h,
                lq,
                lk,
                d,
                dv,
                scale: 1.0 / (d as f64).sqrt(),
                dropout,
            };
            let qkv = || Qkv {
                q: (&q, &lqv),
                k: (&k, &lkv),
                v: (&v, &lvv),
            };
            let (fo, flse) =
                NnOps::attention(&q, &lqv, (&k, &lkv), (&v, &lvv), mask_ref, &g).unwrap();
            let (ko, klse) = compose::attention::attention(qkv(), mask_ref, &g).unwrap();
            close(&format!("{what}: out"), &ko, &fo, &[b, h, lq, dv], dtype);
            close(&format!("{what}: lse"), &klse, &flse, &[b * h, lq], c);
            if fully_masked_row {
                let lse = values(&flse, &[b * h * lq]);
                assert!(
                    lse.contains(&f64::NEG_INFINITY),
                    "{what}: a fully masked row"
                );
            }
            let (dout, ldo) = parts(&rand(&[b, h, lq, dv], dtype, true, &mut rng));
            let (fq, fk, fv) =
                NnOps::attention_backward(&dout, &ldo, qkv(), mask_ref, &flse, &g).unwrap();
            let (kq, kk, kv) =
                compose::attention::attention_backward((&dout, &ldo), qkv(), mask_ref, &flse, &g)
                    .unwrap();
            close(&format!("{what}: dq"), &kq, &fq, &[b, h, lq, d], dtype);
            close(&format!("{what}: dk"), &kk, &fk, &[b, h, lk, d], dtype);
            close(&format!("{what}: dv"), &kv, &fv, &[b, h, lk, dv], dtype);
        }
    }
}

fn f32s(n: usize, lo: f64, hi: f64, rng: &mut Generator) -> CpuStorage {
    CpuStorage::from_vec(
        (0..n)
            .map(|_| rng.uniform(lo, hi) as f32)
            .collect::<Vec<_>>(),
    )
}

#[test]
fn optimizer_steps_match_their_compositions() {
    let mut rng = Generator::new(53);
    let n = 37;
    let lp = Layout::contiguous(&[n]);
    for dtype in DTYPES {
        // The parameter in its dtype, the gradient strided (every other element).
        let p0 = parts(&rand(&[n], dtype, false, &mut rng)).0;
        let (g, lg) = parts(&rand(&[n], dtype, true, &mut rng));
        for (wd, momentum, first, nesterov) in [
            (false, false, false, false),
            (true, true, true, false),
            (true, true, false, true),
            (false, true, false, false),
        ] {
            let what = format!(
                "{dtype:?} sgd wd {wd} momentum {momentum} first {first} nesterov {nesterov}"
            );
            let s = SgdScalars {
                neg_lr: -0.05,
                weight_decay: 0.01,
                momentum: 0.9,
                keep: 0.75,
            };
            let f = SgdFlags {
                weight_decay: wd,
                momentum,
                first,
                nesterov,
            };
            let buf0 = f32s(n, -1.0, 1.0, &mut rng);
            let (mut pf, mut pc) = (p0.clone(), p0.clone());
            let (mut bf, mut bc) = (buf0.clone(), buf0.clone());
            let (bfo, bco) = if momentum {
                (Some(&mut bf), Some(&mut bc))
            } else {
                (None, None)
            };
            OptimOps::sgd_step(&mut pf, &lp, (&g, &lg), bfo, &s, f).unwrap();
            compose::optim::sgd_step(&mut pc, &lp, (&g, &lg), bco, &s, f).unwrap();
            close(&format!("{what}: param"), &pc, &pf, &[n], dtype);
            close(&format!("{what}: buf"), &bc, &bf, &[n], DType::F32);
            assert_ne!(
                values(&pf, &[n]),
                values(&p0, &[n]),
                "{what}: the step moved"
            );
        }
        for (decay, amsgrad, lerp_small) in [
            (AdamDecay::None, false, true),
            (AdamDecay::L2, true, true),
            (AdamDecay::Decoupled, false, false),
        ] {
            let what = format!("{dtype:?} adam {decay:?} amsgrad {amsgrad}");
            let k = AdamScalars {
                decay: if decay == AdamDecay::Decoupled {
                    0.999
                } else {
                    0.01
                },
                lerp_small,
                lerp_coeff: if lerp_small { 0.1 } else { -0.9 },
                beta2: 0.999,
                one_minus_beta2: 0.001,
                bias_correction2_sqrt: 0.0447,
                eps: 1e-8,
                neg_step_size: -0.01,
            };
            let (m0, v0, x0) = (
                f32s(n, -0.5, 0.5, &mut rng),
                f32s(n, 0.0, 0.3, &mut rng),
                f32s(n, 0.0, 0.3, &mut rng),
            );
            let (mut pf, mut mf, mut vf, mut xf) = (p0.clone(), m0.clone(), v0.clone(), x0.clone());
            let (mut pc, mut mc, mut vc, mut xc) = (p0.clone(), m0, v0, x0);
            let (xfo, xco) = if amsgrad {
                (Some(&mut xf), Some(&mut xc))
            } else {
                (None, None)
            };
            let fs = AdamState {
                exp_avg: &mut mf,
                exp_avg_sq: &mut vf,
                max_exp_avg_sq: xfo,
            };
            let cs = AdamState {
                exp_avg: &mut mc,
                exp_avg_sq: &mut vc,
                max_exp_avg_sq: xco,
            };
            OptimOps::adam_step(&mut pf, &lp, (&g, &lg), fs, &k, decay).unwrap();
            compose::optim::adam_step(&mut pc, &lp, (&g, &lg), cs, &k, decay).unwrap();
            close(&format!("{what}: param"), &pc, &pf, &[n], dtype);
            close(&format!("{what}: m"), &mc, &mf, &[n], DType::F32);
            close(&format!("{what}: v"), &vc, &vf, &[n], DType::F32);
            close(&format!("{what}: max"), &xc, &xf, &[n], DType::F32);
        }
    }
    // A momentum step without its buffer is an error, not a panic.
    let (mut p, g) = (f32s(n, -1.0, 1.0, &mut rng), f32s(n, -1.0, 1.0, &mut rng));
    let f = SgdFlags {
        weight_decay: false,
        momentum: true,
        first: false,
        nesterov: false,
    };
    let s = SgdScalars {
        neg_lr: -0.1,
        weight_decay: 0.0,
        momentum: 0.9,
        keep: 1.0,
    };
    assert!(compose::optim::sgd_step(&mut p, &lp, (&g, &lp), None, &s, f).is_err());
}
