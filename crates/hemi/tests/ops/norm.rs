//! Batch norm, layer norm and dropout (the ops with statistics or a training mode) against
//! f64 references per dtype, their gradients by finite differences, running-statistic
//! updates, mixed-precision parameters, dropout's mask statistics, and error cases.

use crate::common;
use common::*;
use hemi::{DType, Error, Generator, Tensor};

// ----- references ---------------------------------------------------------------------------

/// Per-channel mean and biased variance of `x` `[n, c, s]`.
fn channel_stats(x: &[f64], n: usize, c: usize, s: usize) -> (Vec<f64>, Vec<f64>) {
    let m = (n * s) as f64;
    let at = |i: usize, ch: usize, k: usize| x[(i * c + ch) * s + k];
    let mean: Vec<f64> = (0..c)
        .map(|ch| {
            (0..n)
                .flat_map(|i| (0..s).map(move |k| (i, k)))
                .map(|(i, k)| at(i, ch, k))
                .sum::<f64>()
                / m
        })
        .collect();
    let var = (0..c)
        .map(|ch| {
            (0..n)
                .flat_map(|i| (0..s).map(move |k| (i, k)))
                .map(|(i, k)| (at(i, ch, k) - mean[ch]).powi(2))
                .sum::<f64>()
                / m
        })
        .collect();
    (mean, var)
}

/// `(x - mean[c]) / sqrt(var[c] + eps) * w[c] + b[c]` over `[n, c, s]`.
#[allow(clippy::too_many_arguments)]
fn bn_reference(
    x: &[f64],
    (n, c, s): (usize, usize, usize),
    mean: &[f64],
    var: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for i in 0..n {
        for ch in 0..c {
            for k in 0..s {
                let j = (i * c + ch) * s + k;
                let xhat = (x[j] - mean[ch]) / (var[ch] + eps).sqrt();
                out[j] = xhat * w.map_or(1.0, |w| w[ch]) + b.map_or(0.0, |b| b[ch]);
            }
        }
    }
    out
}

/// Layer norm over rows of `d` values.
fn ln_reference(x: &[f64], d: usize, w: Option<&[f64]>, b: Option<&[f64]>, eps: f64) -> Vec<f64> {
    x.chunks(d)
        .flat_map(|row| {
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            row.iter()
                .enumerate()
                .map(move |(j, v)| {
                    (v - mean) * rstd * w.map_or(1.0, |w| w[j]) + b.map_or(0.0, |b| b[j])
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn ncs(shape: &[usize]) -> (usize, usize, usize) {
    (shape[0], shape[1], shape[2..].iter().product())
}

// ----- batch norm ---------------------------------------------------------------------------

const BN_SHAPES: [&[usize]; 4] = [&[4, 3, 5, 7], &[6, 5], &[1, 3, 1, 9], &[3, 1, 2, 3]];

fn batch_norm_training_forward(dtype: DType) {
    let mut rng = Generator::new(11);
    for shape in BN_SHAPES {
        for strided in [false, true] {
            let (x, xv) = rand_tensor(shape, dtype, strided, &mut rng);
            let c = shape[1];
            let w = rand_values(c, 0.5, 1.5, dtype, &mut rng);
            let b = rand_values(c, -0.5, 0.5, dtype, &mut rng);
            let wt = tensor(&w, &[c], dtype, strided);
            let bt = tensor(&b, &[c], dtype, false);
            let out = x
                .batch_norm(None, None, Some(&wt), Some(&bt), true, 0.1, 1e-5)
                .unwrap();
            assert_eq!(out.shape(), shape);
            assert_eq!(out.dtype(), dtype);
            let (n, c, s) = ncs(shape);
            let (mean, var) = channel_stats(&xv, n, c, s);
            let want = bn_reference(&xv, (n, c, s), &mean, &var, Some(&w), Some(&b), 1e-5);
            // Sums of a few hundred O(1) values in F32, one rounding into the dtype.
            assert_close(
                &format!("batch_norm train {dtype} {shape:?} strided={strided}"),
                &out.to_vec_f64(),
                &want,
                balanced(dtype),
            );
            // Without the affine parameters.
            let plain = x
                .batch_norm(None, None, None, None, true, 0.1, 1e-3)
                .unwrap();
            let want = bn_reference(&xv, (n, c, s), &mean, &var, None, None, 1e-3);
            assert_close(
                "batch_norm no affine",
                &plain.to_vec_f64(),
                &want,
                balanced(dtype),
            );
        }
    }
}
dtype_tests!(
    batch_norm_training_matches_f64,
    super::batch_norm_training_forward
);

fn batch_norm_running_stats(dtype: DType) {
    // Two training steps from the default running stats (zeros, ones), then eval with the
    // updated ones, against the same sequence in f64. Running stats stay F32.
    let mut rng = Generator::new(12);
    let shape = [5usize, 3, 4, 3];
    let (n, c, s) = ncs(&shape);
    let rm = Tensor::zeros(&[c], DType::F32).unwrap();
    let rv = Tensor::ones(&[c], DType::F32).unwrap();
    let alias = rm.clone(); // a module holding the same handle sees the update
    let momentum = 0.1;
    let (mut want_m, mut want_v) = (vec![0.0; c], vec![1.0; c]);
    for step in 0..2 {
        // Off-centre inputs so that the running mean moves.
        let xv = rand_values(n * c * s, -0.5, 1.5, dtype, &mut rng);
        let x = tensor(&xv, &shape, dtype, step == 1);
        x.batch_norm(Some(&rm), Some(&rv), None, None, true, momentum, 1e-5)
            .unwrap();
        let (mean, var) = channel_stats(&xv, n, c, s);
        let m = (n * s) as f64;
        for ch in 0..c {
            want_m[ch] = (1.0 - momentum) * want_m[ch] + momentum * mean[ch];
            want_v[ch] = (1.0 - momentum) * want_v[ch] + momentum * var[ch] * m / (m - 1.0);
        }
        assert_eq!(rm.dtype(), DType::F32);
        // Statistics accumulated in F32 and stored in F32.
        assert_close(
            &format!("running_mean step {step}"),
            &rm.to_vec_f64(),
            &want_m,
            balanced(DType::F32),
        );
        assert_close(
            &format!("running_var step {step}"),
            &rv.to_vec_f64(),
            &want_v,
            balanced(DType::F32),
        );
        assert_eq!(alias.to_vec_f64(), rm.to_vec_f64());
    }
    // Eval: normalise with the running stats, leave them alone.
    let (x, xv) = rand_tensor(&shape, dtype, true, &mut rng);
    let w = rand_values(c, 0.5, 1.5, DType::F32, &mut rng);
    let wt = Tensor::from_f64_vec(w.clone(), &[c], DType::F32).unwrap();
    let before = (rm.to_vec_f64(), rv.to_vec_f64());
    let out = x
        .batch_norm(Some(&rm), Some(&rv), Some(&wt), None, false, momentum, 1e-5)
        .unwrap();
    assert_eq!(out.dtype(), dtype);
    assert_eq!((rm.to_vec_f64(), rv.to_vec_f64()), before);
    let want = bn_reference(&xv, (n, c, s), &before.0, &before.1, Some(&w), None, 1e-5);
    assert_close("batch_norm eval", &out.to_vec_f64(), &want, balanced(dtype));
}
dtype_tests!(
    batch_norm_running_stats_and_eval,
    super::batch_norm_running_stats
);

fn batch_norm_half_input_f32_params(dtype: DType) {
    // Mixed precision: F16/BF16 activations, F32 weight, bias and running stats. The output
    // keeps the activations' dtype and each gradient comes back in its tensor's dtype.
    let mut rng = Generator::new(13);
    let shape = [4usize, 3, 5];
    let (x, xv) = rand_tensor(&shape, dtype, false, &mut rng);
    let x = x.requires_grad_();
    let w = rand_values(3, 0.5, 1.5, DType::F32, &mut rng);
    let b = rand_values(3, -0.5, 0.5, DType::F32, &mut rng);
    let wt = Tensor::from_f64_vec(w.clone(), &[3], DType::F32)
        .unwrap()
        .requires_grad_();
    let bt = Tensor::from_f64_vec(b.clone(), &[3], DType::F32)
        .unwrap()
        .requires_grad_();
    let rm = Tensor::zeros(&[3], DType::F32).unwrap();
    let rv = Tensor::ones(&[3], DType::F32).unwrap();
    let out = x
        .batch_norm(Some(&rm), Some(&rv), Some(&wt), Some(&bt), true, 0.1, 1e-5)
        .unwrap();
    assert_eq!(out.dtype(), dtype);
    let (n, c, s) = ncs(&shape);
    let (mean, var) = channel_stats(&xv, n, c, s);
    let want = bn_reference(&xv, (n, c, s), &mean, &var, Some(&w), Some(&b), 1e-5);
    assert_close(
        "mixed batch_norm",
        &out.to_vec_f64(),
        &want,
        balanced(dtype),
    );
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().dtype(), dtype);
    assert_eq!(wt.grad().unwrap().dtype(), DType::F32);
    assert_eq!(bt.grad().unwrap().dtype(), DType::F32);
    // d(sum y)/d bias = m per channel, exactly; d/d weight = sum xhat = 0 up to rounding.
    assert_eq!(bt.grad().unwrap().to_vec_f64(), vec![(n * s) as f64; 3]);
    assert_close(
        "dweight",
        &wt.grad().unwrap().to_vec_f64(),
        &[0.0; 3],
        balanced(DType::F32),
    );
    // The running mean moved in F32, from the half input's values.
    let want_m: Vec<f64> = mean.iter().map(|m| 0.1 * m).collect();
    assert_close(
        "running_mean",
        &rm.to_vec_f64(),
        &want_m,
        balanced(DType::F32),
    );
}
dtype_tests!(
    batch_norm_half_input_with_f32_params,
    super::batch_norm_half_input_f32_params
);

fn batch_norm_backward_matches_f64(dtype: DType) {
    // The closed-form backward for half inputs against the f64 closed form:
    // dx = rstd * w * (g - mean(g) - xhat * mean(g * xhat)).
    let mut rng = Generator::new(14);
    let shape = [3usize, 4, 2, 5];
    let (n, c, s) = ncs(&shape);
    let (x, xv) = rand_tensor(&shape, dtype, true, &mut rng);
    let x = x.contiguous().unwrap().requires_grad_();
    let w = rand_values(c, 0.5, 1.5, dtype, &mut rng);
    let wt = Tensor::from_f64_vec(w.clone(), &[c], dtype).unwrap();
    let (gt, gv) = rand_tensor(&shape, dtype, false, &mut rng);
    let out = x
        .batch_norm(None, None, Some(&wt), None, true, 0.1, 1e-5)
        .unwrap();
    out.mul(&gt).unwrap().sum_all().unwrap().backward().unwrap();
    let (mean, var) = channel_stats(&xv, n, c, s);
    let m = (n * s) as f64;
    let mut want = vec![0.0; xv.len()];
    for ch in 0..c {
        let rstd = 1.0 / (var[ch] + 1e-5).sqrt();
        let idx: Vec<usize> = (0..n)
            .flat_map(|i| (0..s).map(move |k| (i * c + ch) * s + k))
            .collect();
        let xhat = |j: usize| (xv[j] - mean[ch]) * rstd;
        let g_mean = idx.iter().map(|&j| gv[j]).sum::<f64>() / m;
        let gx_mean = idx.iter().map(|&j| gv[j] * xhat(j)).sum::<f64>() / m;
        for &j in &idx {
            want[j] = rstd * w[ch] * (gv[j] - g_mean - xhat(j) * gx_mean);
        }
    }
    // One F32 pass of per-channel sums, then one rounding into the dtype.
    assert_close(
        "batch_norm dx",
        &x.grad().unwrap().to_vec_f64(),
        &want,
        balanced(dtype),
    );
}
dtype_tests!(batch_norm_backward, super::batch_norm_backward_matches_f64);

#[test]
fn batch_norm_gradients() {
    let mut rng = Generator::new(15);
    for shape in [vec![3usize, 4, 5], vec![5, 3], vec![2, 2, 3, 2]] {
        let c = shape[1];
        let x = grad_input(&shape, &mut rng);
        let w = grad_input(&[c], &mut rng);
        let b = grad_input(&[c], &mut rng);
        gradcheck(
            &format!("batch_norm train {shape:?}"),
            &[x.clone(), w.clone(), b.clone()],
            |t| t[0].batch_norm(None, None, Some(&t[1]), Some(&t[2]), true, 0.1, 1e-5),
        );
        gradcheck(
            &format!("batch_norm train no affine {shape:?}"),
            std::slice::from_ref(&x),
            |t| t[0].batch_norm(None, None, None, None, true, 0.1, 1e-5),
        );
        // Eval: the running stats are constants; rebuilt per call so nothing mutates.
        let rm: Vec<f64> = (0..c).map(|_| rng.uniform(-0.5, 0.5)).collect();
        let rv: Vec<f64> = (0..c).map(|_| rng.uniform(0.5, 2.0)).collect();
        gradcheck(&format!("batch_norm eval {shape:?}"), &[x, w, b], |t| {
            let m = Tensor::from_f64_vec(rm.clone(), &[c], DType::F64)?;
            let v = Tensor::from_f64_vec(rv.clone(), &[c], DType::F64)?;
            t[0].batch_norm(
                Some(&m),
                Some(&v),
                Some(&t[1]),
                Some(&t[2]),
                false,
                0.1,
                1e-5,
            )
        });
    }
    // Training with running stats given: the gradient is that of the batch statistics.
    let x = grad_input(&[4, 2, 3], &mut rng);
    gradcheck("batch_norm train with running stats", &[x], |t| {
        let m = Tensor::zeros(&[2], DType::F64)?;
        let v = Tensor::ones(&[2], DType::F64)?;
        t[0].batch_norm(Some(&m), Some(&v), None, None, true, 0.1, 1e-5)
    });
}

#[test]
fn batch_norm_errors() {
    let x = Tensor::zeros(&[4, 3, 2], DType::F32).unwrap();
    let e = |r: hemi::Result<Tensor>| r.unwrap_err().to_string();
    let w4 = Tensor::ones(&[4], DType::F32).unwrap();
    let msg = e(x.batch_norm(None, None, Some(&w4), None, true, 0.1, 1e-5));
    assert!(
        msg.contains("batch_norm") && msg.contains("[4]") && msg.contains("[4, 3, 2]"),
        "{msg}"
    );
    let v = Tensor::zeros(&[5], DType::F32).unwrap();
    let msg = e(v.batch_norm(None, None, None, None, true, 0.1, 1e-5));
    assert!(msg.contains("[5]"), "{msg}");
    // One value per channel cannot be normalised in training.
    let one = Tensor::zeros(&[1, 3], DType::F32).unwrap();
    let msg = e(one.batch_norm(None, None, None, None, true, 0.1, 1e-5));
    assert!(msg.contains("more than one value"), "{msg}");
    // Eval needs running stats; both or neither.
    assert!(x
        .batch_norm(None, None, None, None, false, 0.1, 1e-5)
        .is_err());
    let rm = Tensor::zeros(&[3], DType::F32).unwrap();
    assert!(x
        .batch_norm(Some(&rm), None, None, None, true, 0.1, 1e-5)
        .is_err());
    assert!(x
        .batch_norm(None, None, None, None, true, 0.1, -1.0)
        .is_err());
    let i = Tensor::zeros(&[4, 3], DType::I64).unwrap();
    assert!(matches!(
        i.batch_norm(None, None, None, None, true, 0.1, 1e-5),
        Err(Error::DType { .. })
    ));
}

#[test]
fn long_f16_statistics_accumulate_in_f32() {
    // 4096 values alternating 1 and 1 + 2^-10: mean 1 + 2^-11, variance 2^-22, so with
    // eps = 0 every output is exactly ±1 when the sums are F32 (all partial sums are exact
    // there). An F16 accumulator would stall at 2048 and get the mean, hence everything,
    // wrong.
    let n = 4096;
    let v: Vec<f64> = (0..n)
        .map(|i| if i % 2 == 0 { 1.0 } else { 1.0 + 1.0 / 1024.0 })
        .collect();
    let want: Vec<f64> = (0..n)
        .map(|i| if i % 2 == 0 { -1.0 } else { 1.0 })
        .collect();
    let x = Tensor::from_f64_vec(v.clone(), &[n, 1], DType::F16).unwrap();
    let bn = x
        .batch_norm(None, None, None, None, true, 0.1, 0.0)
        .unwrap();
    assert_eq!(bn.to_vec_f64(), want, "batch_norm");
    let x = Tensor::from_f64_vec(v, &[1, n], DType::F16).unwrap();
    let ln = x.layer_norm(&[n], None, None, 0.0).unwrap();
    assert_eq!(ln.to_vec_f64(), want, "layer_norm");
}

// ----- layer norm ---------------------------------------------------------------------------

fn layer_norm_forward(dtype: DType) {
    let mut rng = Generator::new(21);
    let cases: [(&[usize], &[usize]); 4] = [
        (&[4, 7], &[7]),
        (&[2, 3, 5, 7], &[5, 7]),
        (&[3, 1, 9], &[9]),
        (&[13], &[13]),
    ];
    for (shape, norm) in cases {
        for strided in [false, true] {
            let (x, xv) = rand_tensor(shape, dtype, strided, &mut rng);
            let d: usize = norm.iter().product();
            let w = rand_values(d, 0.5, 1.5, dtype, &mut rng);
            let b = rand_values(d, -0.5, 0.5, dtype, &mut rng);
            let wt = tensor(&w, norm, dtype, strided);
            let bt = tensor(&b, norm, dtype, false);
            let out = x.layer_norm(norm, Some(&wt), Some(&bt), 1e-5).unwrap();
            assert_eq!(out.shape(), shape);
            assert_eq!(out.dtype(), dtype);
            let want = ln_reference(&xv, d, Some(&w), Some(&b), 1e-5);
            assert_close(
                &format!("layer_norm {dtype} {shape:?} over {norm:?} strided={strided}"),
                &out.to_vec_f64(),
                &want,
                balanced(dtype),
            );
            let plain = x.layer_norm(norm, None, None, 1e-3).unwrap();
            let want = ln_reference(&xv, d, None, None, 1e-3);
            assert_close(
                "layer_norm no affine",
                &plain.to_vec_f64(),
                &want,
                balanced(dtype),
            );
        }
    }
    // F32 parameters with a half input: the output keeps the input's dtype.
    let (x, xv) = rand_tensor(&[3, 8], dtype, false, &mut rng);
    let w = rand_values(8, 0.5, 1.5, DType::F32, &mut rng);
    let wt = Tensor::from_f64_vec(w.clone(), &[8], DType::F32).unwrap();
    let out = x.layer_norm(&[8], Some(&wt), None, 1e-5).unwrap();
    assert_eq!(out.dtype(), dtype);
    assert_close(
        "layer_norm f32 weight",
        &out.to_vec_f64(),
        &ln_reference(&xv, 8, Some(&w), None, 1e-5),
        balanced(dtype),
    );
}
dtype_tests!(layer_norm_matches_f64, super::layer_norm_forward);

#[test]
fn layer_norm_gradients() {
    let mut rng = Generator::new(22);
    let cases: [(&[usize], &[usize]); 3] =
        [(&[3, 5], &[5]), (&[2, 3, 4], &[3, 4]), (&[4, 1, 3], &[3])];
    for (shape, norm) in cases {
        let x = grad_input(shape, &mut rng);
        let w = grad_input(norm, &mut rng);
        let b = grad_input(norm, &mut rng);
        gradcheck(
            &format!("layer_norm {shape:?} over {norm:?}"),
            &[x.clone(), w, b],
            |t| t[0].layer_norm(norm, Some(&t[1]), Some(&t[2]), 1e-5),
        );
        gradcheck(&format!("layer_norm no affine {shape:?}"), &[x], |t| {
            t[0].layer_norm(norm, None, None, 1e-5)
        });
    }
}

#[test]
fn layer_norm_errors() {
    let x = Tensor::zeros(&[2, 3, 4], DType::F32).unwrap();
    let msg = x
        .layer_norm(&[3], None, None, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("layer_norm") && msg.contains("[3]") && msg.contains("[2, 3, 4]"),
        "{msg}"
    );
    assert!(x.layer_norm(&[], None, None, 1e-5).is_err());
    assert!(x.layer_norm(&[1, 2, 3, 4], None, None, 1e-5).is_err());
    let w = Tensor::ones(&[3, 4, 1], DType::F32).unwrap();
    let msg = x
        .layer_norm(&[3, 4], Some(&w), None, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("weight") && msg.contains("[3, 4, 1]"), "{msg}");
    assert!(x.layer_norm(&[4], None, None, f64::NAN).is_err());
}

// ----- dropout ------------------------------------------------------------------------------

fn dropout_forward(dtype: DType) {
    let mut rng = Generator::new(31);
    let p = 0.3;
    let (x, xv) = rand_tensor(&[9, 13], dtype, true, &mut rng);
    let out = x.dropout(p, true, &mut Generator::new(5)).unwrap();
    assert_eq!(out.dtype(), dtype);
    let got = out.to_vec_f64();
    // Every element is either dropped (0) or the input scaled by 1/(1-p), rounded once.
    let kept: Vec<bool> = got.iter().map(|&g| g != 0.0).collect();
    let want: Vec<f64> = xv
        .iter()
        .zip(&kept)
        .map(|(&v, &k)| if k { v / (1.0 - p) } else { 0.0 })
        .collect();
    assert_close("dropout kept values", &got, &want, strict(dtype));
    assert!(kept.iter().any(|&k| k) && kept.iter().any(|&k| !k));
    // The mask follows the logical order: a strided view and its contiguous copy agree.
    let dense = x
        .contiguous()
        .unwrap()
        .dropout(p, true, &mut Generator::new(5))
        .unwrap();
    assert_eq!(dense.to_vec_f64(), got);
    // Same seed, same mask; another seed, another mask.
    let again = x.dropout(p, true, &mut Generator::new(5)).unwrap();
    assert_eq!(again.to_vec_f64(), got);
    let other = x.dropout(p, true, &mut Generator::new(6)).unwrap();
    assert_ne!(other.to_vec_f64(), got);
}
dtype_tests!(dropout_scales_kept_values, super::dropout_forward);

#[test]
fn dropout_statistics() {
    // 100k elements: the kept count is Binomial(n, 1-p); allow 5 standard deviations
    // (a false failure has probability below 1e-6; the generator is seeded anyway).
    let n = 100_000;
    let x = Tensor::ones(&[n], DType::F32).unwrap();
    for p in [0.1, 0.5, 0.9] {
        let out = x
            .dropout(p, true, &mut Generator::new(42))
            .unwrap()
            .to_vec_f64();
        let kept = out.iter().filter(|&&v| v != 0.0).count() as f64;
        let expect = n as f64 * (1.0 - p);
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (kept - expect).abs() < 5.0 * sd,
            "p={p}: kept {kept}, expected {expect} ± {}",
            5.0 * sd
        );
        // The mean is preserved (the same bound, scaled by 1/(n(1-p))).
        let mean = out.iter().sum::<f64>() / n as f64;
        let bound = 5.0 * sd / expect + 1e-6;
        assert!((mean - 1.0).abs() < bound, "p={p}: mean {mean}");
    }
}

#[test]
fn dropout_modes_and_edges() {
    let mut rng = Generator::new(33);
    let (x, _) = rand_tensor(&[4, 5], DType::F16, false, &mut rng);
    // Eval and p = 0 are the identity: the same tensor, and no draws from the generator.
    let mut g = Generator::new(1);
    for (p, training) in [(0.5, false), (0.0, true), (1.0, false)] {
        let y = x.dropout(p, training, &mut g).unwrap();
        assert!(y.same_storage(&x) && y.shape() == x.shape());
    }
    assert_eq!(g.next_u64(), Generator::new(1).next_u64());
    // p = 1 drops everything.
    let z = x.dropout(1.0, true, &mut g).unwrap();
    assert!(z.to_vec_f64().iter().all(|&v| v == 0.0));
    // Probabilities outside [0, 1] are errors.
    for p in [-0.1, 1.5, f64::NAN] {
        let msg = x.dropout(p, true, &mut g).unwrap_err().to_string();
        assert!(msg.contains("dropout"), "{msg}");
    }
    let i = Tensor::zeros(&[3], DType::I64).unwrap();
    assert!(i.dropout(0.5, true, &mut g).is_err());
}

#[test]
fn dropout_gradient() {
    // gradcheck re-runs the forward: each call clones one fixed generator, so every pass
    // draws the same mask.
    let mut rng = Generator::new(34);
    let gen = Generator::new(77);
    let x = grad_input(&[6, 7], &mut rng);
    gradcheck("dropout", std::slice::from_ref(&x), |t| {
        t[0].dropout(0.4, true, &mut gen.clone())
    });
    // The backward applies the mask and scale: d(sum y)/dx = mask / (1 - p).
    let xt = Tensor::from_f64_vec(x.0, &[6, 7], DType::F64)
        .unwrap()
        .requires_grad_();
    let y = xt.dropout(0.4, true, &mut gen.clone()).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let yv = y.to_vec_f64();
    let want: Vec<f64> = yv
        .iter()
        .map(|&v| if v != 0.0 { 1.0 / 0.6 } else { 0.0 })
        .collect();
    assert_close(
        "dropout grad",
        &xt.grad().unwrap().to_vec_f64(),
        &want,
        strict(DType::F64),
    );
    // p = 1: the gradient is zero.
    let xt = Tensor::ones(&[3], DType::F64).unwrap().requires_grad_();
    xt.dropout(1.0, true, &mut gen.clone())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(xt.grad().unwrap().to_vec_f64(), vec![0.0; 3]);
}
