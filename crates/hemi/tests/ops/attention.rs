//! Scaled-dot-product attention against an f64 reference composed here, per dtype: odd
//! sizes (Lq ≠ Lk, D = 7, Dv = 5, leading dims [2, 3]), permuted (BERT-style) views, padding
//! masks broadcast from `[B, 1, 1, Lk]`, fully masked rows; gradients by finite differences
//! in F64 and against the composed ops' autograd (matmul + softmax + matmul) in F32 and in
//! half precision; dropout's determinism, kept fraction and gradient; errors; and (ignored)
//! the speed and memory of the fused op against the composed one.

use crate::common;
use common::*;
use hemi::{amp::autocast, DType, Generator, Tensor};

// ----- reference ------------------------------------------------------------------------------

/// `softmax(scale · q kᵀ + mask) v` in f64 over `heads` heads; `mask` (when given) holds the
/// `[heads, lq, lk]` values already broadcast. Fully -inf rows give zeros.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&[f64]>,
    (heads, lq, lk, d, dv): (usize, usize, usize, usize, usize),
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; heads * lq * dv];
    for h in 0..heads {
        for i in 0..lq {
            let s: Vec<f64> = (0..lk)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|c| q[(h * lq + i) * d + c] * k[(h * lk + j) * d + c])
                        .sum();
                    dot * scale + mask.map_or(0.0, |m| m[(h * lq + i) * lk + j])
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, ej) in e.iter().enumerate() {
                for c in 0..dv {
                    out[(h * lq + i) * dv + c] += ej / sum * v[(h * lk + j) * dv + c];
                }
            }
        }
    }
    out
}

/// The output's tolerance: scores are sums of `d` products and the output a sum over `lk`
/// keys, both in the compute type; the output is rounded once into the dtype. Values are
/// O(1) (inputs in [-1, 1)), so the compute type's error is O((d + lk)·u) absolute. BF16
/// rounds the probabilities before `P·V` (as PyTorch's CPU flash attention): since they sum
/// to 1, that adds at most `u · max|v|`, inside the second `u` of `rtol`/`atol`.
fn attn_tol(dtype: DType, d: usize, lk: usize) -> Tol {
    let c = if dtype == DType::F64 {
        u(DType::F64)
    } else {
        u(DType::F32)
    };
    Tol {
        rtol: 2.0 * u(dtype),
        atol: 2.0 * u(dtype) + 16.0 * (d + lk) as f64 * c,
    }
}

/// A BERT-style view: values `[b, h, l, d]` stored as `[b, l, h·d]` (one projection),
/// reshaped to `[b, l, h, d]` and permuted to `[b, h, l, d]` (not contiguous).
fn bert_view(values: &[f64], (b, h, l, d): (usize, usize, usize, usize), dtype: DType) -> Tensor {
    let mut stored = vec![0.0; values.len()];
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                for c in 0..d {
                    stored[((bi * l + li) * h + hi) * d + c] =
                        values[((bi * h + hi) * l + li) * d + c];
                }
            }
        }
    }
    let t = Tensor::from_f64_vec(stored, &[b, l, h * d], dtype)
        .unwrap()
        .reshape(&[b, l, h, d])
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap();
    assert!(!t.is_contiguous());
    t
}

/// A padding mask `[b, 1, 1, lk]`: batch `bi` keeps its first `lk - bi - 1` keys (at least
/// one), the rest get `neg`; and the same broadcast to `[b, h, lq, lk]` for the reference.
fn padding_mask(b: usize, h: usize, lq: usize, lk: usize, neg: f64) -> (Vec<f64>, Vec<f64>) {
    let m: Vec<f64> = (0..b)
        .flat_map(|bi| (0..lk).map(move |j| if j + bi + 1 >= lk && j > 0 { neg } else { 0.0 }))
        .collect();
    let mut full = Vec::with_capacity(b * h * lq * lk);
    for bi in 0..b {
        for _ in 0..h * lq {
            full.extend_from_slice(&m[bi * lk..][..lk]);
        }
    }
    (m, full)
}

// ----- forward ----------------------------------------------------------------------------

fn forward_matches_f64(dtype: DType) {
    let mut rng = Generator::new(11);
    let (b, h, lq, lk, d, dv) = (2, 3, 5, 6, 7, 5);
    let heads = b * h;
    let qv = rand_values(heads * lq * d, -1.0, 1.0, dtype, &mut rng);
    let kv = rand_values(heads * lk * d, -1.0, 1.0, dtype, &mut rng);
    let vv = rand_values(heads * lk * dv, -1.0, 1.0, dtype, &mut rng);
    let dims = (heads, lq, lk, d, dv);
    let tol = attn_tol(dtype, d, lk);
    for strided in [false, true] {
        let q = tensor(&qv, &[b, h, lq, d], dtype, strided);
        let k = tensor(&kv, &[b, h, lk, d], dtype, strided);
        let v = tensor(&vv, &[b, h, lk, dv], dtype, strided);
        // Default scale, no mask.
        let out = q
            .scaled_dot_product_attention(&k, &v, None, 0.0, None, None)
            .unwrap();
        assert_eq!(out.shape(), [b, h, lq, dv]);
        assert_eq!(out.dtype(), dtype);
        let want = reference(&qv, &kv, &vv, None, dims, 1.0 / (d as f64).sqrt());
        assert_close(
            &format!("sdpa {dtype} strided={strided}"),
            &out.to_vec_f64(),
            &want,
            tol,
        );
        // A padding mask [b, 1, 1, lk] in F32 whatever the dtype, and a given scale.
        let (m, full) = padding_mask(b, h, lq, lk, -1e4);
        let mt = Tensor::from_f64_vec(m, &[b, 1, 1, lk], DType::F32).unwrap();
        let out = q
            .scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, Some(0.3))
            .unwrap();
        let want = reference(&qv, &kv, &vv, Some(&full), dims, 0.3);
        assert_close(
            &format!("sdpa {dtype} masked strided={strided}"),
            &out.to_vec_f64(),
            &want,
            tol,
        );
    }
    // A full per-query mask [lq, lk] (broadcast over both leading dims), in the dtype.
    let mv = rand_values(lq * lk, -3.0, 3.0, dtype, &mut rng);
    let mt = Tensor::from_f64_vec(mv.clone(), &[lq, lk], dtype).unwrap();
    let full: Vec<f64> = (0..heads).flat_map(|_| mv.iter().cloned()).collect();
    let q = Tensor::from_f64_vec(qv.clone(), &[b, h, lq, d], dtype).unwrap();
    let k = Tensor::from_f64_vec(kv.clone(), &[b, h, lk, d], dtype).unwrap();
    let v = Tensor::from_f64_vec(vv.clone(), &[b, h, lk, dv], dtype).unwrap();
    let out = q
        .scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, None)
        .unwrap();
    let want = reference(&qv, &kv, &vv, Some(&full), dims, 1.0 / (d as f64).sqrt());
    assert_close(
        &format!("sdpa {dtype} [lq, lk] mask"),
        &out.to_vec_f64(),
        &want,
        tol,
    );
}
dtype_tests!(forward, super::forward_matches_f64);

#[test]
fn forward_f64_and_bert_views() {
    // F64 is the reference dtype: near exact. And BERT's own layout, [B, L, H·D] permuted.
    let mut rng = Generator::new(12);
    let (b, h, l, d) = (2, 3, 9, 4);
    let n = b * h * l * d;
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        let (qv, kv, vv) = (
            rand_values(n, -1.0, 1.0, dtype, &mut rng),
            rand_values(n, -1.0, 1.0, dtype, &mut rng),
            rand_values(n, -1.0, 1.0, dtype, &mut rng),
        );
        let (q, k, v) = (
            bert_view(&qv, (b, h, l, d), dtype),
            bert_view(&kv, (b, h, l, d), dtype),
            bert_view(&vv, (b, h, l, d), dtype),
        );
        let (m, full) = padding_mask(b, h, l, l, -1e9);
        let mt = Tensor::from_f64_vec(m, &[b, 1, 1, l], DType::F32).unwrap();
        let out = q
            .scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, None)
            .unwrap();
        let want = reference(&qv, &kv, &vv, Some(&full), (b * h, l, l, d, d), 0.5);
        assert_close(
            &format!("bert view {dtype}"),
            &out.to_vec_f64(),
            &want,
            attn_tol(dtype, d, l),
        );
    }
}

#[test]
fn fully_masked_rows() {
    let mut rng = Generator::new(13);
    let (heads, lq, lk, d, dv) = (2, 3, 4, 5, 3);
    let dtype = DType::F32;
    let qv = rand_values(heads * lq * d, -1.0, 1.0, dtype, &mut rng);
    let kv = rand_values(heads * lk * d, -1.0, 1.0, dtype, &mut rng);
    let vv = rand_values(heads * lk * dv, -1.0, 1.0, dtype, &mut rng);
    let q = Tensor::from_f64_vec(qv.clone(), &[heads, lq, d], dtype)
        .unwrap()
        .requires_grad_();
    let k = Tensor::from_f64_vec(kv.clone(), &[heads, lk, d], dtype)
        .unwrap()
        .requires_grad_();
    let v = Tensor::from_f64_vec(vv.clone(), &[heads, lk, dv], dtype)
        .unwrap()
        .requires_grad_();
    // Row 1 of every head fully masked with a large finite negative (f32::MIN as HF's BERT
    // does): a uniform softmax over the row's keys, never NaN.
    let mut m = vec![0.0; lq * lk];
    m[lk..2 * lk].iter_mut().for_each(|x| *x = f32::MIN as f64);
    let mt = Tensor::from_f64_vec(m.clone(), &[lq, lk], DType::F32).unwrap();
    let out = q
        .scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, None)
        .unwrap();
    let got = out.to_vec_f64();
    assert!(
        got.iter().all(|x| x.is_finite()),
        "finite mask gave {got:?}"
    );
    for hh in 0..heads {
        for c in 0..dv {
            let mean: f64 = (0..lk).map(|j| vv[(hh * lk + j) * dv + c]).sum::<f64>() / lk as f64;
            let g = got[(hh * lq + 1) * dv + c];
            assert!(
                (g - mean).abs() < 1e-5,
                "head {hh} col {c}: {g} vs uniform mean {mean}"
            );
        }
    }
    // With -inf the row has no softmax: zeros, and zero gradients through it.
    m[lk..2 * lk]
        .iter_mut()
        .for_each(|x| *x = f64::NEG_INFINITY);
    let mt = Tensor::from_f64_vec(m.clone(), &[lq, lk], DType::F32).unwrap();
    let out = q
        .scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, None)
        .unwrap();
    let got = out.to_vec_f64();
    let full: Vec<f64> = (0..heads).flat_map(|_| m.iter().cloned()).collect();
    let want = reference(
        &qv,
        &kv,
        &vv,
        Some(&full),
        (heads, lq, lk, d, dv),
        1.0 / (d as f64).sqrt(),
    );
    assert_close("-inf row", &got, &want, attn_tol(dtype, d, lk));
    for hh in 0..heads {
        assert!(got[(hh * lq + 1) * dv..][..dv].iter().all(|&x| x == 0.0));
    }
    out.sum_all().unwrap().backward().unwrap();
    let dq = q.grad().unwrap().to_vec_f64();
    assert!(dq.iter().all(|x| x.is_finite()));
    for hh in 0..heads {
        assert!(
            dq[(hh * lq + 1) * d..][..d].iter().all(|&x| x == 0.0),
            "dq of a masked row"
        );
    }
    assert!(k.grad().unwrap().to_vec_f64().iter().all(|x| x.is_finite()));
}

#[test]
fn empty_and_degenerate_sizes() {
    // No queries: an empty output; one key: the output is that key's value.
    let q = Tensor::zeros(&[2, 0, 3], DType::F32).unwrap();
    let k = Tensor::ones(&[2, 4, 3], DType::F32).unwrap();
    let v = Tensor::ones(&[2, 4, 2], DType::F32).unwrap();
    let out = q
        .scaled_dot_product_attention(&k, &v, None, 0.0, None, None)
        .unwrap();
    assert_eq!(out.shape(), [2, 0, 2]);
    // No keys: every row fully masked, zeros (and zero gradients); D = 0: uniform weights.
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let q = Tensor::ones(&[2, 3, 4], dtype).unwrap().requires_grad_();
        let k = Tensor::ones(&[2, 0, 4], dtype).unwrap().requires_grad_();
        let v = Tensor::ones(&[2, 0, 5], dtype).unwrap();
        let out = q
            .scaled_dot_product_attention(&k, &v, None, 0.0, None, None)
            .unwrap();
        assert_eq!(out.to_vec_f64(), vec![0.0; 30], "{dtype}");
        out.sum_all().unwrap().backward().unwrap();
        assert_eq!(q.grad().unwrap().to_vec_f64(), vec![0.0; 24]);
        let q = Tensor::ones(&[1, 2, 0], dtype).unwrap();
        let k = Tensor::ones(&[1, 2, 0], dtype).unwrap();
        let v = Tensor::from_f64_vec(vec![1.0, 3.0], &[1, 2, 1], dtype).unwrap();
        let out = q
            .scaled_dot_product_attention(&k, &v, None, 0.0, None, None)
            .unwrap();
        assert_eq!(out.to_vec_f64(), [2.0, 2.0], "{dtype}");
    }
    let q = Tensor::ones(&[1, 3, 3], DType::BF16).unwrap();
    let k = Tensor::ones(&[1, 1, 3], DType::BF16).unwrap();
    let v = Tensor::from_f64_vec(vec![0.25, -2.0], &[1, 1, 2], DType::BF16).unwrap();
    let out = q
        .scaled_dot_product_attention(&k, &v, None, 0.0, None, None)
        .unwrap();
    assert_eq!(out.to_vec_f64(), [0.25, -2.0, 0.25, -2.0, 0.25, -2.0]);
}

// ----- gradients --------------------------------------------------------------------------

#[test]
fn gradients_by_finite_differences() {
    let mut rng = Generator::new(21);
    let (b, h, lq, lk, d, dv) = (2, 1, 3, 4, 7, 5);
    let (m, _) = padding_mask(b, 1, 1, lk, -50.0);
    let mt = Tensor::from_f64_vec(m, &[b, 1, 1, lk], DType::F64).unwrap();
    let inputs = [
        grad_input(&[b, h, lq, d], &mut rng),
        grad_input(&[b, h, lk, d], &mut rng),
        grad_input(&[b, h, lk, dv], &mut rng),
    ];
    gradcheck("sdpa", &inputs, |t| {
        t[0].scaled_dot_product_attention(&t[1], &t[2], None, 0.0, None, None)
    });
    gradcheck("sdpa masked, scale 0.7", &inputs, |t| {
        t[0].scaled_dot_product_attention(&t[1], &t[2], Some(&mt), 0.0, None, Some(0.7))
    });
    // Permuted views of the leaves.
    gradcheck("sdpa transposed views", &inputs, |t| {
        let q = t[0].transpose(-1, -2)?.contiguous()?.transpose(-1, -2)?;
        let k = t[1].transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
        q.scaled_dot_product_attention(&k, &t[2], Some(&mt), 0.0, None, None)
    });
}

/// The composed ops: `softmax(q kᵀ · scale + mask) v` from matmul, softmax and matmul.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64) -> Tensor {
    let s = q
        .matmul(&k.transpose(-1, -2).unwrap())
        .unwrap()
        .mul_scalar(scale)
        .unwrap();
    let s = match mask {
        Some(m) => s.add(m).unwrap(),
        None => s,
    };
    s.softmax(-1).unwrap().matmul(v).unwrap()
}

/// The gradients of q, k and v.
type Grads3 = Vec<Vec<f64>>;

/// Gradients of q, k, v of `sum(out · w)`: the fused op in `dtype`, the composed ops in
/// `dtype`, the fused op in F64.
fn grads_both(dtype: DType, seed: u64) -> (Grads3, Grads3, Grads3) {
    grads_both_sized(dtype, seed, (2, 3, 5, 6, 7, 5))
}

/// As `grads_both`, for `(b, h, lq, lk, d, dv)`.
fn grads_both_sized(
    dtype: DType,
    seed: u64,
    (b, h, lq, lk, d, dv): (usize, usize, usize, usize, usize, usize),
) -> (Grads3, Grads3, Grads3) {
    let mut rng = Generator::new(seed);
    let shapes = [[b, h, lq, d], [b, h, lk, d], [b, h, lk, dv]];
    let vals: Vec<Vec<f64>> = shapes
        .iter()
        .map(|s| rand_values(s.iter().product(), -1.0, 1.0, dtype, &mut rng))
        .collect();
    let w = rand_values(b * h * lq * dv, -1.0, 1.0, dtype, &mut rng);
    let (m, _) = padding_mask(b, h, lq, lk, -1e4);
    let run = |fused: bool, dt: DType| -> Vec<Vec<f64>> {
        let leaves: Vec<Tensor> = vals
            .iter()
            .zip(&shapes)
            .map(|(v, s)| {
                Tensor::from_f64_vec(v.clone(), s, dt)
                    .unwrap()
                    .requires_grad_()
            })
            .collect();
        let mt = Tensor::from_f64_vec(m.clone(), &[b, 1, 1, lk], dt).unwrap();
        let out = if fused {
            leaves[0]
                .scaled_dot_product_attention(&leaves[1], &leaves[2], Some(&mt), 0.0, None, None)
                .unwrap()
        } else {
            composed(
                &leaves[0],
                &leaves[1],
                &leaves[2],
                Some(&mt),
                1.0 / (d as f64).sqrt(),
            )
        };
        let wt = Tensor::from_f64_vec(w.clone(), out.shape(), dt).unwrap();
        out.mul(&wt).unwrap().sum_all().unwrap().backward().unwrap();
        leaves
            .iter()
            .map(|t| t.grad().unwrap().to_vec_f64())
            .collect()
    };
    (run(true, dtype), run(false, dtype), run(true, DType::F64))
}

/// F32 gradients of the fused op within the dtype's balanced tolerance of the composed ops'
/// and of the fused op's in F64.
fn assert_f32_grads((fused, comp, exact): (Grads3, Grads3, Grads3)) {
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        let tol = balanced(DType::F32);
        assert_close(
            &format!("{name} fused vs composed"),
            &fused[i],
            &comp[i],
            tol,
        );
        assert_close(&format!("{name} fused vs f64"), &fused[i], &exact[i], tol);
    }
}

#[test]
fn gradients_match_composed_ops_f32() {
    assert_f32_grads(grads_both(DType::F32, 22));
}

/// Many query blocks with a partial last one (1100 keys give blocks of 16 rows; 150 rows
/// are 9 full blocks and 6 rows), so dK and dV add several blocks' products.
#[test]
fn gradients_over_several_query_blocks_f32() {
    assert_f32_grads(grads_both_sized(DType::F32, 24, (1, 2, 150, 1100, 9, 3)));
}

fn half_gradients(dtype: DType) {
    // Half inputs: the fused op's gradients come from F32 sums rounded once (BF16 also
    // rounds P and dS before their products, each within a rounding of the dtype), so they
    // sit within the dtype's rounding (plus F32 error over the lengths) of the F64 gradients;
    // the composed ops round the scores, probabilities and each product into the dtype.
    let (fused, comp, exact) = grads_both(dtype, 23);
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        assert_close(
            &format!("{name} {dtype} fused vs f64"),
            &fused[i],
            &exact[i],
            attn_tol(dtype, 7, 6),
        );
        assert_close(
            &format!("{name} {dtype} composed vs f64"),
            &comp[i],
            &exact[i],
            permissive(dtype),
        );
    }
}

#[test]
fn gradients_half_f16() {
    half_gradients(DType::F16)
}

#[test]
fn gradients_half_bf16() {
    half_gradients(DType::BF16)
}

// ----- dropout ----------------------------------------------------------------------------

#[test]
fn dropout_is_deterministic_and_keeps_one_minus_p() {
    // q = 0 gives uniform probabilities 1/lk; v the identity per head, so out[i][j] =
    // keep_ij / (lk (1-p)): the output shows the mask.
    let (heads, lq, lk) = (8, 32, 32);
    let p = 0.3;
    let q = Tensor::zeros(&[heads, lq, 4], DType::F32).unwrap();
    let k = Tensor::ones(&[heads, lk, 4], DType::F32).unwrap();
    let eye: Vec<f64> = (0..heads * lk * lk)
        .map(|i| {
            if (i % (lk * lk)) / lk == i % lk {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let v = Tensor::from_f64_vec(eye, &[heads, lk, lk], DType::F32).unwrap();
    let run = |seed: u64| {
        let mut g = Generator::new(seed);
        q.scaled_dot_product_attention(&k, &v, None, p, Some(&mut g), None)
            .unwrap()
            .to_vec_f64()
    };
    let (a, b, c) = (run(5), run(5), run(6));
    assert_eq!(a, b, "same seed, same mask");
    assert_ne!(a, c, "another seed, another mask");
    let unit = 1.0 / (lk as f64 * (1.0 - p));
    let mut kept = 0usize;
    for &x in &a {
        if x == 0.0 {
            continue;
        }
        assert!(
            (x - unit).abs() < 1e-6 * unit,
            "kept value {x}, want {unit}"
        );
        kept += 1;
    }
    let n = a.len() as f64;
    let frac = kept as f64 / n;
    let sd = (p * (1.0 - p) / n).sqrt();
    assert!(
        (frac - (1.0 - p)).abs() < 5.0 * sd,
        "kept {frac}, want {} ± {}",
        1.0 - p,
        5.0 * sd
    );
}

#[test]
fn dropout_gradient_uses_the_forward_mask() {
    // The same seed in every evaluation: the objective is a fixed function, and the analytic
    // gradient (recomputing the mask in the backward) must match its finite differences.
    let mut rng = Generator::new(31);
    let inputs = [
        grad_input(&[2, 4, 3], &mut rng),
        grad_input(&[2, 5, 3], &mut rng),
        grad_input(&[2, 5, 2], &mut rng),
    ];
    gradcheck("sdpa dropout", &inputs, |t| {
        let mut g = Generator::new(77);
        t[0].scaled_dot_product_attention(&t[1], &t[2], None, 0.4, Some(&mut g), None)
    });
}

#[test]
fn dropout_needs_a_generator() {
    let q = Tensor::ones(&[1, 2, 3], DType::F32).unwrap();
    let err = q
        .scaled_dot_product_attention(&q, &q, None, 0.1, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scaled_dot_product_attention") && err.contains("rng"),
        "{err}"
    );
    let mut g = Generator::new(1);
    for p in [1.0, -0.1, f64::NAN] {
        assert!(
            q.scaled_dot_product_attention(&q, &q, None, p, Some(&mut g), None)
                .is_err(),
            "p = {p}"
        );
    }
}

// ----- errors and autocast ----------------------------------------------------------------

#[test]
fn bad_inputs_are_errors() {
    let t = |s: &[usize], dt: DType| Tensor::zeros(s, dt).unwrap();
    let f = DType::F32;
    let sdpa = |q: &Tensor, k: &Tensor, v: &Tensor, m: Option<&Tensor>| {
        q.scaled_dot_product_attention(k, v, m, 0.0, None, None)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let (q, k, v) = (
        t(&[2, 3, 5, 7], f),
        t(&[2, 3, 6, 7], f),
        t(&[2, 3, 6, 5], f),
    );
    let e = sdpa(&q, &t(&[2, 3, 6, 8], f), &v, None);
    assert!(
        e.contains("scaled_dot_product_attention") && e.contains("[2, 3, 6, 8]"),
        "{e}"
    );
    assert!(sdpa(&q, &k, &t(&[2, 3, 4, 5], f), None).contains("values"));
    assert!(sdpa(&q, &t(&[2, 4, 6, 7], f), &v, None).contains("leading"));
    assert!(sdpa(&q, &t(&[6, 7], f), &v, None).contains("rank"));
    assert!(sdpa(&t(&[7], f), &t(&[7], f), &t(&[7], f), None).contains("rank"));
    assert!(sdpa(&t(&[2, 3, 5, 7], DType::I64), &k, &v, None).contains("float"));
    let e = sdpa(&q, &k, &v, Some(&t(&[2, 1, 1, 5], f)));
    assert!(e.contains("attn_mask") && e.contains("[2, 1, 1, 5]"), "{e}");
    assert!(sdpa(&q, &k, &v, Some(&t(&[1, 2, 3, 5, 6], f))).contains("attn_mask"));
    assert!(sdpa(&q, &k, &v, Some(&t(&[2, 1, 1, 6], DType::I64))).contains("float"));
    assert!(q
        .scaled_dot_product_attention(&k, &v, None, 0.0, None, Some(f64::INFINITY))
        .is_err());
}

#[test]
fn mixed_dtypes_promote() {
    let mut rng = Generator::new(42);
    let (q, _) = rand_tensor(&[3, 4], DType::BF16, false, &mut rng);
    let (k, _) = rand_tensor(&[5, 4], DType::F32, false, &mut rng);
    let (v, _) = rand_tensor(&[5, 2], DType::F16, false, &mut rng);
    let out = q
        .scaled_dot_product_attention(&k, &v, None, 0.0, None, None)
        .unwrap();
    assert_eq!(out.dtype(), DType::F32);
    let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let want = up(&q)
        .scaled_dot_product_attention(&up(&k), &up(&v), None, 0.0, None, None)
        .unwrap();
    assert_eq!(out.to_vec_f64(), want.to_vec_f64());
}

#[test]
fn autocast_runs_in_the_lower_dtype_and_keeps_the_mask() {
    let mut rng = Generator::new(41);
    let (q, qv) = rand_tensor(&[2, 4, 8], DType::F32, false, &mut rng);
    let (k, kv) = rand_tensor(&[2, 4, 8], DType::F32, false, &mut rng);
    let (v, vv) = rand_tensor(&[2, 4, 8], DType::F32, false, &mut rng);
    // f32::MIN would become -inf in F16; the mask is read in F32 and stays finite.
    let m =
        Tensor::from_f64_vec(vec![0.0, 0.0, 0.0, f32::MIN as f64], &[1, 1, 4], DType::F32).unwrap();
    let out = {
        let _ac = autocast(DType::F16);
        q.scaled_dot_product_attention(&k, &v, Some(&m), 0.0, None, None)
            .unwrap()
    };
    assert_eq!(out.dtype(), DType::F16);
    let r = |x: &[f64]| round_to(x, DType::F16);
    let full: Vec<f64> = (0..8)
        .flat_map(|_| [0.0, 0.0, 0.0, f32::MIN as f64])
        .collect();
    let want = reference(
        &r(&qv),
        &r(&kv),
        &r(&vv),
        Some(&full),
        (2, 4, 4, 8, 8),
        1.0 / 8f64.sqrt(),
    );
    assert_close(
        "autocast f16",
        &out.to_vec_f64(),
        &want,
        attn_tol(DType::F16, 8, 4),
    );
}

// ----- speed (ignored: run with --ignored --nocapture) --------------------------------------

/// Median seconds of `runs` calls of `f`, after one warm-up call.
fn median_secs(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = std::time::Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[runs / 2]
}

#[test]
#[ignore]
fn attention_speed() {
    // BERT-MiniLM fine-tuning: B=32, H=12, L=64, D=32, q/k/v permuted views of [B, L, H·D].
    let (b, h, l, d) = (32, 12, 64, 32);
    let mut rng = Generator::new(51);
    let (m, _) = padding_mask(b, 1, 1, l, -1e4);
    for dtype in [DType::F32, DType::BF16] {
        let mk = |rng: &mut Generator| {
            let v = rand_values(b * h * l * d, -1.0, 1.0, dtype, rng);
            bert_view(&v, (b, h, l, d), dtype).detach().requires_grad_()
        };
        // Leaves are the permuted views' bases (detach keeps the view), as in a model.
        let (q, k, v) = (mk(&mut rng), mk(&mut rng), mk(&mut rng));
        let mt = Tensor::from_f64_vec(m.clone(), &[b, 1, 1, l], dtype).unwrap();
        let g = Tensor::ones(&[b, h, l, d], dtype).unwrap();
        let fused_fwd = || {
            let _ng = hemi::no_grad();
            q.scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, None)
                .unwrap();
        };
        let comp_fwd = || {
            let _ng = hemi::no_grad();
            composed(&q, &k, &v, Some(&mt), 1.0 / (d as f64).sqrt());
        };
        let fused = || {
            let o = q
                .scaled_dot_product_attention(&k, &v, Some(&mt), 0.0, None, None)
                .unwrap();
            hemi::autograd::backward_with(&o, g.clone()).unwrap();
        };
        let comp = || {
            let o = composed(&q, &k, &v, Some(&mt), 1.0 / (d as f64).sqrt());
            hemi::autograd::backward_with(&o, g.clone()).unwrap();
        };
        let runs = 7;
        let (ff, cf) = (median_secs(runs, fused_fwd), median_secs(runs, comp_fwd));
        let (fb, cb) = (median_secs(runs, fused), median_secs(runs, comp));
        let scores = b * h * l * l;
        println!(
            "{dtype}: forward fused {:.1} ms, composed {:.1} ms; forward+backward fused {:.1} ms, \
             composed {:.1} ms",
            ff * 1e3,
            cf * 1e3,
            fb * 1e3,
            cb * 1e3
        );
        println!(
            "{dtype}: saved for backward: fused log-sum-exp {} KiB; [B,H,L,L] probabilities in \
             {dtype} {} KiB (composed keeps them plus the scores: each [B,H,L,L] tensor is {} KiB, \
             and its forward makes 4: q·kᵀ, ·scale, +mask, softmax)",
            b * h * l * 4 / 1024,
            scores * dtype.size_in_bytes() / 1024,
            scores * dtype.size_in_bytes() / 1024,
        );
    }
}
