//! The ops a BERT encoder needs besides attention, where the existing suites left a gap:
//! gelu / gelu_tanh / tanh gradients in half precision (the F64 finite-difference checks are
//! in `elementwise.rs`), layer_norm with BERT's eps 1e-12 on `[B, L, H]` over the last dim
//! (including constant rows, where eps alone sets the scale), embedding's scatter-add of
//! repeated ids from a `[B, L]` batch per dtype, and batched matmul broadcasting
//! `[2, 1, 5, 7] x [3, 7, 4]` forward and backward per dtype.

use crate::common;
use common::*;
use hemi::{DType, Generator, Tensor};

// ----- activations ------------------------------------------------------------------------

type Act = (
    &'static str,
    fn(&Tensor) -> hemi::Result<Tensor>,
    fn(f64) -> f64,
);

fn activations() -> [Act; 3] {
    [
        (
            "gelu",
            |t| t.gelu(),
            |x| 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt())),
        ),
        (
            "gelu_tanh",
            |t| t.gelu_tanh(),
            |x| {
                0.5 * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
            },
        ),
        ("tanh", |t| t.tanh(), f64::tanh),
    ]
}

/// The backward of each activation in `dtype` against the derivative of the f64 reference by
/// central differences (step 1e-5: truncation error ~1e-10, far below half precision): the
/// gradient `g · f'(x)` is computed in F32 and rounded once, so the elementwise tolerance
/// holds, with room for the finite difference itself.
fn activation_gradients(dtype: DType) {
    let mut rng = Generator::new(61);
    for (name, op, f) in activations() {
        let n = 257;
        let xv = rand_values(n, -5.0, 5.0, dtype, &mut rng);
        let gv = rand_values(n, -2.0, 2.0, dtype, &mut rng);
        let x = tensor(&xv, &[n], dtype, true).detach().requires_grad_();
        let g = Tensor::from_f64_vec(gv.clone(), &[n], dtype).unwrap();
        let y = op(&x).unwrap();
        assert_eq!(y.dtype(), dtype);
        hemi::autograd::backward_with(&y, g).unwrap();
        let dx = x.grad().unwrap();
        assert_eq!(dx.dtype(), dtype, "{name}");
        let h = 1e-5;
        let want: Vec<f64> = xv
            .iter()
            .zip(&gv)
            .map(|(&x, &g)| g * (f(x + h) - f(x - h)) / (2.0 * h))
            .collect();
        let tol = strict(dtype);
        let got = dx.to_vec_f64();
        for i in 0..n {
            // tanh's backward reads its output, rounded into the dtype (as PyTorch's
            // tanh_backward): 1 - y² then errs by up to 2u·|y|, an absolute error of
            // 2u·|g| that near saturation (y rounds to ±1) is all of the gradient.
            let from_output = if name == "tanh" {
                3.0 * u(dtype) * gv[i].abs()
            } else {
                0.0
            };
            let bound = tol.atol.max(1e-8) + tol.rtol * want[i].abs() + from_output;
            assert!(
                (got[i] - want[i]).abs() <= bound,
                "d{name} {dtype}[{i}] at x = {}: got {}, want {} (bound {bound:.2e})",
                xv[i],
                got[i],
                want[i]
            );
        }
    }
}
dtype_tests!(activation_gradients_match_f64, super::activation_gradients);

// ----- layer norm -------------------------------------------------------------------------

/// Layer norm over rows of `d` values in f64.
fn ln_reference(x: &[f64], d: usize, w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|row| {
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            row.iter()
                .enumerate()
                .map(move |(j, v)| (v - mean) * rstd * w[j] + b[j])
                .collect::<Vec<_>>()
        })
        .collect()
}

fn layer_norm_bert(dtype: DType) {
    let mut rng = Generator::new(62);
    let (bsz, l, hid) = (2, 5, 24);
    for eps in [1e-12, 1e-5] {
        for strided in [false, true] {
            let (x, mut xv) = rand_tensor(&[bsz, l, hid], dtype, strided, &mut rng);
            // Row 3 constant: var = 0, the output is the bias whatever eps (1e-12 -> rstd 1e6).
            let x = if strided {
                x
            } else {
                xv[3 * hid..4 * hid].iter_mut().for_each(|v| *v = 0.75);
                Tensor::from_f64_vec(xv.clone(), &[bsz, l, hid], dtype).unwrap()
            };
            let w = rand_values(hid, 0.5, 1.5, DType::F32, &mut rng);
            let b = rand_values(hid, -0.5, 0.5, DType::F32, &mut rng);
            let wt = Tensor::from_f64_vec(w.clone(), &[hid], DType::F32).unwrap();
            let bt = Tensor::from_f64_vec(b.clone(), &[hid], DType::F32).unwrap();
            let out = x.layer_norm(&[hid], Some(&wt), Some(&bt), eps).unwrap();
            assert_eq!((out.shape(), out.dtype()), (&[bsz, l, hid][..], dtype));
            let want = ln_reference(&xv, hid, &w, &b, eps);
            assert_close(
                &format!("layer_norm {dtype} eps {eps} strided={strided}"),
                &out.to_vec_f64(),
                &want,
                balanced(dtype),
            );
            if !strided {
                // The constant row is exactly the bias rounded into the dtype.
                let got = &out.to_vec_f64()[3 * hid..4 * hid];
                assert_eq!(got, &round_to(&b, dtype)[..], "constant row, eps {eps}");
            }
        }
    }
}
dtype_tests!(layer_norm_bert_shapes, super::layer_norm_bert);

#[test]
fn layer_norm_gradients_bert_eps() {
    let mut rng = Generator::new(63);
    for eps in [1e-12, 1e-5] {
        let inputs = [
            grad_input(&[2, 3, 8], &mut rng),
            grad_input(&[8], &mut rng),
            grad_input(&[8], &mut rng),
        ];
        gradcheck(&format!("layer_norm eps {eps}"), &inputs, |t| {
            t[0].layer_norm(&[8], Some(&t[1]), Some(&t[2]), eps)
        });
    }
}

// ----- embedding --------------------------------------------------------------------------

fn embedding_scatter(dtype: DType) {
    // Token ids [B, L] with repeats (a padding id 0 many times, as in a padded batch): the
    // weight's gradient is the f64 scatter-add of the output gradients, summed in F32 and
    // rounded once (up to 12 terms of O(1): within the dtype's rounding plus F32 error).
    let mut rng = Generator::new(64);
    let (vocab, hid, bsz, l) = (11, 6, 3, 8);
    let idv: Vec<i64> = (0..bsz * l)
        .map(|i| {
            if i % l >= 5 {
                0
            } else {
                rng.below(vocab as u64) as i64
            }
        })
        .collect();
    let ids = Tensor::from_vec(idv.clone(), &[bsz, l]).unwrap();
    let (w, wv) = rand_tensor(&[vocab, hid], dtype, false, &mut rng);
    let w = w.requires_grad_();
    let out = Tensor::embedding(&w, &ids).unwrap();
    assert_eq!(out.shape(), [bsz, l, hid]);
    let want_out: Vec<f64> = idv
        .iter()
        .flat_map(|&i| wv[i as usize * hid..][..hid].to_vec())
        .collect();
    assert_eq!(out.to_vec_f64(), want_out);
    let gv = rand_values(bsz * l * hid, -1.0, 1.0, dtype, &mut rng);
    let g = Tensor::from_f64_vec(gv.clone(), &[bsz, l, hid], dtype).unwrap();
    hemi::autograd::backward_with(&out, g).unwrap();
    let mut want = vec![0.0; vocab * hid];
    let mut abs = vec![0.0; vocab * hid];
    for (t, &i) in idv.iter().enumerate() {
        for c in 0..hid {
            want[i as usize * hid + c] += gv[t * hid + c];
            abs[i as usize * hid + c] += gv[t * hid + c].abs();
        }
    }
    let dw = w.grad().unwrap();
    assert_eq!(dw.dtype(), dtype);
    assert_sums_close(
        "embedding scatter-add",
        &dw.to_vec_f64(),
        &want,
        &abs,
        bsz * l,
        dtype,
    );
    assert!(
        idv.iter().filter(|&&i| i == 0).count() >= bsz * 3,
        "repeats"
    );
}
dtype_tests!(
    embedding_scatter_adds_repeated_ids,
    super::embedding_scatter
);

// ----- batched matmul with broadcasting ---------------------------------------------------

fn matmul_broadcast(dtype: DType) {
    // [2, 1, 5, 7] x [3, 7, 4] -> [2, 3, 5, 4]; dA sums over the 3 broadcast B's, dB over the
    // 2 broadcast A's.
    let mut rng = Generator::new(65);
    let (a, av) = rand_tensor(&[2, 1, 5, 7], dtype, true, &mut rng);
    let (b, bv) = rand_tensor(&[3, 7, 4], dtype, false, &mut rng);
    let (a, b) = (a.detach().requires_grad_(), b.requires_grad_());
    let out = a.matmul(&b).unwrap();
    assert_eq!(out.shape(), [2, 3, 5, 4]);
    let at = |i: usize, r: usize, c: usize| av[(i * 5 + r) * 7 + c];
    let bt = |j: usize, r: usize, c: usize| bv[(j * 7 + r) * 4 + c];
    let (mut want, mut mag) = (vec![0.0; 2 * 3 * 5 * 4], vec![0.0; 2 * 3 * 5 * 4]);
    for i in 0..2 {
        for j in 0..3 {
            for r in 0..5 {
                for c in 0..4 {
                    let o = ((i * 3 + j) * 5 + r) * 4 + c;
                    for kk in 0..7 {
                        want[o] += at(i, r, kk) * bt(j, kk, c);
                        mag[o] += (at(i, r, kk) * bt(j, kk, c)).abs();
                    }
                }
            }
        }
    }
    assert_sums_close("broadcast matmul", &out.to_vec_f64(), &want, &mag, 7, dtype);
    let gv = rand_values(out.numel(), -1.0, 1.0, dtype, &mut rng);
    let g = Tensor::from_f64_vec(gv.clone(), out.shape(), dtype).unwrap();
    hemi::autograd::backward_with(&out, g).unwrap();
    let gt = |i: usize, j: usize, r: usize, c: usize| gv[((i * 3 + j) * 5 + r) * 4 + c];
    // dA[i, r, k] = Σ_j Σ_c g[i, j, r, c] b[j, k, c] (12 terms); dB[j, k, c] = Σ_i Σ_r
    // a[i, r, k] g[i, j, r, c] (10 terms). Their sums round in F32 and through one half
    // rounding of the broadcast partial products at most: checked at two half roundings.
    let (mut da, mut da_mag) = (vec![0.0; 2 * 5 * 7], vec![0.0; 2 * 5 * 7]);
    for i in 0..2 {
        for r in 0..5 {
            for kk in 0..7 {
                for j in 0..3 {
                    for c in 0..4 {
                        let p = gt(i, j, r, c) * bt(j, kk, c);
                        da[(i * 5 + r) * 7 + kk] += p;
                        da_mag[(i * 5 + r) * 7 + kk] += p.abs();
                    }
                }
            }
        }
    }
    let (mut db, mut db_mag) = (vec![0.0; 3 * 7 * 4], vec![0.0; 3 * 7 * 4]);
    for j in 0..3 {
        for kk in 0..7 {
            for c in 0..4 {
                for i in 0..2 {
                    for r in 0..5 {
                        let p = at(i, r, kk) * gt(i, j, r, c);
                        db[(j * 7 + kk) * 4 + c] += p;
                        db_mag[(j * 7 + kk) * 4 + c] += p.abs();
                    }
                }
            }
        }
    }
    let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
    assert_eq!(
        (ga.shape(), gb.shape()),
        (&[2, 1, 5, 7][..], &[3, 7, 4][..])
    );
    let check = |what: &str, got: &[f64], want: &[f64], mag: &[f64]| {
        for i in 0..got.len() {
            let bound = 2.0 * (1.01 * 12.0 * u(DType::F32) * mag[i])
                + 2.0 * u(dtype) * (want[i].abs() + mag[i])
                + 1e-30;
            assert!(
                (got[i] - want[i]).abs() <= bound,
                "{what} {dtype}[{i}]: got {}, want {} (bound {bound:.2e})",
                got[i],
                want[i]
            );
        }
    };
    check("dA", &ga.to_vec_f64(), &da, &da_mag);
    check("dB", &gb.to_vec_f64(), &db, &db_mag);
}
dtype_tests!(matmul_broadcast_leading_dims, super::matmul_broadcast);

// ----- speed (ignored: run with --ignored --nocapture) --------------------------------------

fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = std::time::Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[runs / 2]
}

#[test]
#[ignore]
fn elementwise_speed() {
    // BERT-MiniLM fine-tuning activations: batch 32 x length 64 rows of H = 384 or 4H = 1536.
    let mut rng = Generator::new(66);
    for (rows, cols) in [(2048, 384), (2048, 1536)] {
        for dtype in [DType::F32, DType::BF16] {
            let x = Tensor::randn(&[rows, cols], 0.0, 1.0, dtype, &mut rng)
                .unwrap()
                .requires_grad_();
            let y = Tensor::randn(&[rows, cols], 0.0, 1.0, dtype, &mut rng).unwrap();
            let w = Tensor::ones(&[cols], DType::F32).unwrap().requires_grad_();
            let b = Tensor::zeros(&[cols], DType::F32).unwrap().requires_grad_();
            let g = Tensor::ones(&[rows, cols], dtype).unwrap();
            type Op<'a> = (&'static str, Box<dyn Fn() -> Tensor + 'a>);
            let ops: Vec<Op> = vec![
                (
                    "layer_norm",
                    Box::new(|| x.layer_norm(&[cols], Some(&w), Some(&b), 1e-12).unwrap()),
                ),
                ("gelu", Box::new(|| x.gelu().unwrap())),
                ("softmax", Box::new(|| x.softmax(-1).unwrap())),
                ("add", Box::new(|| x.add(&y).unwrap())),
            ];
            for (name, op) in &ops {
                let fwd = median_ms(7, || {
                    let _ng = hemi::no_grad();
                    op();
                });
                let both = median_ms(7, || {
                    let out = op();
                    hemi::autograd::backward_with(&out, g.to_dtype(out.dtype()).unwrap()).unwrap();
                });
                println!("[{rows}, {cols}] {dtype} {name}: forward {fwd:.2} ms, forward+backward {both:.2} ms");
            }
        }
    }
}
