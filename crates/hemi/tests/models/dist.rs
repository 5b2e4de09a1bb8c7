//! Data parallelism with ranks as threads (`LocalTransport`): the ring all-reduce against an
//! f64 reference, the half-precision wire formats, faults, the bucketed reducer, and whole
//! training runs on 2 ranks against 1 rank with twice the batch.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use hemi::amp::Precision;
use hemi::data::{DataLoader, LoaderConfig, Shard, Split, Synthetic, Transform};
use hemi::dist::{
    DistConfig, GradReducer, LocalTransport, ProcessGroup, ReducerConfig, Wire, ZeroStage,
};
use hemi::models::Mlp;
use hemi::nn::Module;
use hemi::train::{train, OptimizerKind, RunInfo, Summary, TrainConfig};
use hemi::{DType, Generator, Tensor};

/// `n` ranks as threads; `f(group)` runs on each, results in rank order.
fn on_ranks<T: Send + 'static>(
    n: usize,
    timeout: Duration,
    f: impl Fn(Arc<ProcessGroup>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = LocalTransport::group(n)
        .into_iter()
        .map(|t| {
            let f = f.clone();
            thread::spawn(move || {
                let g = Arc::new(ProcessGroup::new(Box::new(t), timeout).unwrap());
                f(g)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn values(rank: usize, n: usize, scale: f32) -> Vec<f32> {
    let mut g = Generator::new(100 + rank as u64);
    let t = Tensor::randn(&[n], 0.0, 1.0, DType::F32, &mut g).unwrap();
    t.to_vec_f32().into_iter().map(|x| x * scale).collect()
}

/// The f64 sum over ranks of `values(r, n, scale)` and the sum of magnitudes.
fn reference(ranks: usize, n: usize, scale: f32) -> (Vec<f64>, Vec<f64>) {
    let mut sum = vec![0.0; n];
    let mut mag = vec![0.0; n];
    for r in 0..ranks {
        for (i, v) in values(r, n, scale).into_iter().enumerate() {
            sum[i] += f64::from(v);
            mag[i] += f64::from(v).abs();
        }
    }
    (sum, mag)
}

fn all_reduce_on(ranks: usize, n: usize, scale: f32, wire: Wire) -> Vec<Vec<f32>> {
    on_ranks(ranks, Duration::from_secs(20), move |g| {
        let data = values(g.rank(), n, scale);
        g.all_reduce(data, wire).unwrap().wait().unwrap()
    })
}

#[test]
fn ring_all_reduce_matches_an_f64_sum_and_is_the_same_on_every_rank() {
    for ranks in 1..=5 {
        for n in [1usize, 2, 7, 1001] {
            let got = all_reduce_on(ranks, n, 1.0, Wire::F32);
            let (want, mag) = reference(ranks, n, 1.0);
            for r in 1..ranks {
                assert_eq!(
                    got[r].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    got[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{ranks} ranks, n={n}: rank {r} differs from rank 0"
                );
            }
            // N − 1 F32 additions, each off by at most half an ulp of the partial sum.
            let u = f64::from(f32::EPSILON) / 2.0;
            for i in 0..n {
                let tol = (ranks as f64 - 1.0) * u * mag[i] * 1.01;
                assert!(
                    (f64::from(got[0][i]) - want[i]).abs() <= tol,
                    "{ranks} ranks, n={n}, [{i}]: {} vs {} (tol {tol:e})",
                    got[0][i],
                    want[i]
                );
            }
            // Bit-reproducible for a given N.
            let again = all_reduce_on(ranks, n, 1.0, Wire::F32);
            assert_eq!(
                again[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                got[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{ranks} ranks, n={n}: not reproducible"
            );
        }
    }
}

/// Half wire: every value, and every partial sum sent on, is rounded once to the wire
/// dtype, so the error is at most N roundings of the magnitudes summed so far.
fn check_half_wire(wire: Wire, scale: f32) {
    let u = match wire {
        Wire::F16 => 2f64.powi(-11),
        Wire::Bf16 => 2f64.powi(-8),
        Wire::F32 => unreachable!(),
    };
    for ranks in [2usize, 3, 4] {
        let n = 517;
        let got = all_reduce_on(ranks, n, scale, wire);
        let (want, mag) = reference(ranks, n, scale);
        for r in 1..ranks {
            assert_eq!(got[r], got[0], "{wire:?}, {ranks} ranks: rank {r} differs");
        }
        for i in 0..n {
            assert!(
                got[0][i].is_finite(),
                "{wire:?} scale {scale}: overflow at {i}"
            );
            let tol = ranks as f64 * u * mag[i] * 1.01 + f64::from(scale) * 1e-6;
            assert!(
                (f64::from(got[0][i]) - want[i]).abs() <= tol,
                "{wire:?}, scale {scale}, {ranks} ranks, [{i}]: {} vs {} (tol {tol:e})",
                got[0][i],
                want[i]
            );
        }
    }
}

#[test]
fn f16_wire_is_prescaled_so_large_and_tiny_gradients_survive() {
    // Values near the F16 maximum would overflow when summed; values near 1e-9 would flush
    // to zero without the agreed power-of-two prescale.
    for scale in [1.0, 2.0e4, 1.0e-9] {
        check_half_wire(Wire::F16, scale);
    }
}

#[test]
fn bf16_wire_is_within_its_rounding() {
    for scale in [1.0, 1.0e30, 1.0e-30] {
        check_half_wire(Wire::Bf16, scale);
    }
}

#[test]
fn non_finite_values_reach_every_rank_even_on_a_half_wire() {
    for wire in [Wire::F32, Wire::F16, Wire::Bf16] {
        let got = on_ranks(3, Duration::from_secs(20), move |g| {
            let mut d = vec![1.0f32; 10];
            if g.rank() == 1 {
                d[4] = f32::INFINITY;
            }
            g.all_reduce(d, wire).unwrap().wait().unwrap()
        });
        for (r, v) in got.iter().enumerate() {
            assert_eq!(v[4], f32::INFINITY, "{wire:?}: rank {r} lost the inf");
            assert_eq!(v[0], 3.0, "{wire:?}: rank {r}");
        }
    }
}

#[test]
fn a_rank_that_goes_away_is_an_error_naming_it_not_a_hang() {
    let start = Instant::now();
    let got = on_ranks(2, Duration::from_millis(1500), |g| {
        if g.rank() == 1 {
            // Rank 1 "dies": it leaves without taking part.
            return Ok(Vec::new());
        }
        g.all_reduce(vec![1.0; 100], Wire::F32).unwrap().wait()
    });
    let err = got[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("rank 0") && err.contains("rank 1"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));

    // A peer alive but silent: the deadline ends the wait.
    let start = Instant::now();
    let got = on_ranks(2, Duration::from_millis(500), |g| {
        if g.rank() == 1 {
            thread::sleep(Duration::from_secs(3));
            return Ok(Vec::new());
        }
        g.all_reduce(vec![1.0; 100], Wire::F32).unwrap().wait()
    });
    let err = got[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("within"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn reducer_averages_gradients_in_reverse_order_buckets() {
    let out = on_ranks(3, Duration::from_secs(20), |g| {
        let r = g.rank() as f64;
        let params: Vec<Tensor> = [5usize, 300, 7, 64]
            .iter()
            .map(|&n| Tensor::zeros(&[n], DType::F32).unwrap().requires_grad_())
            .collect();
        let cfg = ReducerConfig {
            wire: Wire::F32,
            bucket_bytes: 1024,
        };
        let red = GradReducer::new(g.clone(), params.clone(), cfg).unwrap();
        let buckets = red.buckets().to_vec();
        // loss = Σ_i (r + 1)(i + 1) · Σ p_i: gradients are (r + 1)(i + 1) everywhere.
        let mut loss = Tensor::zeros(&[], DType::F32).unwrap();
        for (i, p) in params.iter().enumerate() {
            let term = p
                .sum_all()
                .unwrap()
                .mul_scalar((r + 1.0) * (i as f64 + 1.0))
                .unwrap();
            loss = loss.add(&term).unwrap();
        }
        loss.backward().unwrap();
        red.finish().unwrap();
        let grads: Vec<Vec<f32>> = params
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f32())
            .collect();
        (buckets, grads)
    });
    // Reverse order; a bucket closes once it holds ≥ 1024 bytes (64 + 7 + 300 floats).
    assert_eq!(out[0].0, vec![vec![3, 2, 1], vec![0]]);
    for (buckets, grads) in &out {
        assert_eq!(buckets, &out[0].0);
        for (i, g) in grads.iter().enumerate() {
            // mean over ranks of (r + 1)(i + 1) = 2 (i + 1)
            let want = 2.0 * (i as f32 + 1.0);
            assert!(g.iter().all(|&x| x == want), "param {i}: {:?}", &g[..3]);
        }
    }
}

// ---- whole training runs ----

fn loaders_n(shard: Shard, batch: usize, n_train: usize) -> (DataLoader, DataLoader) {
    let tr = Arc::new(Synthetic::generate(3, Split::Train, n_train));
    let te = Arc::new(Synthetic::generate(3, Split::Test, 64));
    let cfg = |shuffle| LoaderConfig {
        batch_size: batch,
        shuffle,
        seed: 5,
        workers: 1,
        transform: Transform::to_tensor_normalize_half(),
        ..Default::default()
    };
    let test_shard = Shard {
        pad: false,
        ..shard
    };
    (
        DataLoader::new(tr, cfg(true))
            .unwrap()
            .sharded(shard)
            .unwrap(),
        DataLoader::new(te, cfg(false))
            .unwrap()
            .sharded(test_shard)
            .unwrap(),
    )
}

fn info(precision: Precision) -> RunInfo {
    RunInfo {
        model: "mlp".into(),
        dataset: "synthetic".into(),
        data_dir: None,
        input_shape: [3, 32, 32],
        classes: 10,
        seed: 1,
        precision: precision.name().into(),
        ..Default::default()
    }
}

fn base(precision: Precision) -> TrainConfig {
    TrainConfig {
        epochs: 2,
        optimizer: OptimizerKind::Sgd,
        lr: 0.05,
        momentum: 0.9,
        log_every: 1000,
        precision,
        ..Default::default()
    }
}

fn mlp() -> Mlp {
    Mlp::new(3 * 32 * 32, 24, 10, &mut Generator::new(1)).unwrap()
}

fn params_of(m: &Mlp) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| p.to_dtype(DType::F32).unwrap().to_vec_f32())
        .collect()
}

/// A run on one rank with batch 2B split into 2 micro-batches (the same samples, in the same
/// order of addition, as 2 ranks × B).
fn one_rank(cfg: TrainConfig, batch: usize) -> (Vec<Vec<f32>>, Summary) {
    one_rank_n(cfg, batch, 256)
}

fn one_rank_n(cfg: TrainConfig, batch: usize, n_train: usize) -> (Vec<Vec<f32>>, Summary) {
    let (tr, te) = loaders_n(Shard::default(), 2 * batch, n_train);
    let mut m = mlp();
    let cfg = TrainConfig {
        micro_batches: 2,
        ..cfg
    };
    let s = train(&mut m, &tr, &te, &cfg, &info(cfg.precision), &mut |_| {}).unwrap();
    (params_of(&m), s)
}

fn two_ranks(cfg: TrainConfig, batch: usize, wire: Wire) -> Vec<(Vec<Vec<f32>>, Summary)> {
    two_ranks_n(cfg, batch, wire, 256)
}

fn two_ranks_n(
    cfg: TrainConfig,
    batch: usize,
    wire: Wire,
    n_train: usize,
) -> Vec<(Vec<Vec<f32>>, Summary)> {
    on_ranks(2, Duration::from_secs(60), move |g| {
        let mut m = mlp();
        let reducer = ReducerConfig {
            wire,
            bucket_bytes: 16 << 10,
        };
        let s = train_rank(g, &mut m, cfg.clone(), batch, n_train, reducer).unwrap();
        (params_of(&m), s)
    })
}

/// Rank `g.rank()` of 2 trains `m` on its shard of the synthetic set.
fn train_rank(
    g: Arc<ProcessGroup>,
    m: &mut Mlp,
    cfg: TrainConfig,
    batch: usize,
    n_train: usize,
    reducer: ReducerConfig,
) -> hemi::Result<Summary> {
    let shard = Shard {
        rank: g.rank(),
        world: 2,
        pad: true,
    };
    let (tr, te) = loaders_n(shard, batch, n_train);
    let cfg = TrainConfig {
        dist: Some(DistConfig {
            group: g,
            reducer,
            zero: hemi::dist::ZeroStage::Off,
        }),
        ..cfg
    };
    train(m, &tr, &te, &cfg, &info(cfg.precision), &mut |_| {})
}

fn bits(p: &[Vec<f32>]) -> Vec<Vec<u32>> {
    p.iter()
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn two_ranks_equal_one_rank_with_twice_the_batch_bit_for_bit_in_fp32_and_amp() {
    for precision in [Precision::Fp32, Precision::AmpBf16, Precision::AmpFp16] {
        let (want, s1) = one_rank(base(precision), 16);
        let got = two_ranks(base(precision), 16, Wire::F32);
        for (r, (p, s)) in got.iter().enumerate() {
            assert_eq!(
                bits(p),
                bits(&want),
                "{}: rank {r}'s parameters differ from 1 rank × 2B",
                precision.name()
            );
            assert_eq!(s.steps, s1.steps);
            assert_eq!(s.skipped_steps, s1.skipped_steps);
            assert_eq!(s.final_scale, s1.final_scale);
            assert_eq!(s.test_accuracy, s1.test_accuracy, "{}", precision.name());
        }
        assert!(s1.steps > 10);
    }
}

#[test]
fn half_wire_and_fp16_master_stay_within_tolerance_of_one_rank() {
    // Relative distance of the final parameters from the 1-rank run's, per tensor.
    fn rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| {
                let d: f64 = x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)).sum();
                let n: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum();
                (d / n.max(1e-30)).sqrt()
            })
            .fold(0.0, f64::max)
    }
    // 16 steps of momentum SGD amplify the per-step wire rounding (measured on Zen 3: F16
    // 2.2e-4, BF16 3.4e-2); the bounds leave a few times that. With half gradients (fp16
    // master, pure bf16) the F32 sum of two half values rounded once is nearly always the
    // half sum one rank computes, so those runs came out bit-identical (0); the bound
    // allows for the rare double rounding.
    for (precision, wire, tol) in [
        (Precision::Fp32, Wire::F16, 2e-3),
        (Precision::Fp32, Wire::Bf16, 0.1),
        (Precision::Fp16Master, Wire::F32, 1e-3),
        (Precision::Fp16Master, Wire::F16, 1e-3),
        (Precision::PureBf16, Wire::Bf16, 1e-3),
    ] {
        // A start scale that never overflows: one rank's F16 sum of two micro-batch
        // gradients can overflow where the ranks' F32 sum does not, and a skipped step
        // would make the runs incomparable.
        let mut cfg = base(precision);
        cfg.scaler.init_scale = 1024.0;
        let (want, s1) = one_rank(cfg.clone(), 16);
        let got = two_ranks(cfg, 16, wire);
        assert_eq!(
            s1.skipped_steps, got[0].1.skipped_steps,
            "{precision:?}/{wire:?}"
        );
        assert_eq!(
            bits(&got[0].0),
            bits(&got[1].0),
            "{precision:?}/{wire:?}: replicas differ"
        );
        let d = rel(&got[0].0, &want);
        assert!(
            d <= tol,
            "{precision:?} with {wire:?} wire: rel. distance {d:e} > {tol:e}"
        );
    }
}

#[test]
fn an_inf_on_one_rank_makes_every_rank_skip() {
    let cfg = TrainConfig {
        inject_inf: Some((1, 3)),
        epochs: 1,
        ..base(Precision::AmpFp16)
    };
    let clean = two_ranks(
        TrainConfig {
            inject_inf: None,
            ..cfg.clone()
        },
        16,
        Wire::F16,
    );
    let got = two_ranks(cfg, 16, Wire::F16);
    for (r, (p, s)) in got.iter().enumerate() {
        assert_eq!(s.skipped_steps, clean[r].1.skipped_steps + 1, "rank {r}");
        assert_eq!(
            s.final_scale, got[0].1.final_scale,
            "rank {r}: scales differ"
        );
        assert_eq!(bits(p), bits(&got[0].0), "rank {r}: replicas differ");
        assert!(p.iter().flatten().all(|x| x.is_finite()));
    }
}

#[test]
fn replicas_that_differ_are_named_at_start() {
    let start_error = |g: Arc<ProcessGroup>, mut m: Mlp, cfg: TrainConfig| {
        train_rank(g, &mut m, cfg, 16, 256, ReducerConfig::default())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let got = on_ranks(2, Duration::from_secs(20), move |g| {
        let lr = if g.rank() == 1 { 0.1 } else { 0.05 };
        let cfg = TrainConfig {
            lr,
            ..base(Precision::Fp32)
        };
        start_error(g, mlp(), cfg)
    });
    for e in &got {
        assert!(e.contains("lr"), "{e}");
    }

    // Same settings, different initial parameters.
    let got = on_ranks(2, Duration::from_secs(20), move |g| {
        let m = Mlp::new(3 * 32 * 32, 24, 10, &mut Generator::new(g.rank() as u64)).unwrap();
        start_error(g, m, base(Precision::Fp32))
    });
    for e in &got {
        assert!(e.contains("parameters"), "{e}");
    }
}

/// One step of SGD: the update is lr · g, so the distance of the half-wire run's parameters
/// from the exact one's, relative to how far the step moved them, is the relative error of
/// the averaged gradient: two roundings to the wire dtype (the sender's values, the owner's
/// sum), each within half an ulp, so at most 2u in norm.
#[test]
fn one_step_with_a_half_wire_is_within_the_wire_rounding() {
    let w0 = params_of(&mlp());
    for (wire, u) in [(Wire::F16, 2f64.powi(-11)), (Wire::Bf16, 2f64.powi(-8))] {
        for precision in [Precision::Fp32, Precision::AmpFp16] {
            let cfg = TrainConfig {
                epochs: 1,
                ..base(precision)
            };
            let (want, s1) = one_rank_n(cfg.clone(), 16, 32);
            assert_eq!(s1.steps, 1);
            let got = two_ranks_n(cfg, 16, wire, 32);
            for (t, ((x, y), z)) in got[0].0.iter().zip(&want).zip(&w0).enumerate() {
                let d: f64 = x.iter().zip(y).map(|(p, q)| f64::from(p - q).powi(2)).sum();
                let n: f64 = y
                    .iter()
                    .zip(z)
                    .map(|(q, z)| f64::from(*q - *z).powi(2))
                    .sum();
                let rel = (d / n).sqrt();
                assert!(
                    rel <= 2.0 * u && rel > 0.0,
                    "{precision:?}, {wire:?} wire, tensor {t}: relative update error {rel:e} \
                     (bound 2u = {:e})",
                    2.0 * u
                );
            }
        }
    }
}

// ---- SyncBatchNorm ----

#[test]
fn all_reduce_sum_is_differentiable() {
    let out = on_ranks(3, Duration::from_secs(20), |g| {
        let r = g.rank() as f32;
        let x = Tensor::from_vec(vec![r + 1.0, 2.0 * (r + 1.0)], &[2])
            .unwrap()
            .requires_grad_();
        let y = hemi::dist::all_reduce_sum(&g, &x).unwrap();
        let w = Tensor::from_vec(vec![r, 1.0], &[2]).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        (y.to_vec_f32(), x.grad().unwrap().to_vec_f32())
    });
    for (y, gx) in out {
        assert_eq!(y, vec![6.0, 12.0]);
        // d(Σ_r w_r·y)/dx_r = Σ_r w_r
        assert_eq!(gx, vec![3.0, 3.0]);
    }
}

/// One forward and backward of resnet20 on rows `rows` of a fixed batch; the loss is
/// `Σ logits ⊙ W / rows` (the mean over the rows of a fixed linear function of the logits).
fn resnet_step(
    sync: Option<Arc<ProcessGroup>>,
    rows: std::ops::Range<usize>,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut gen = Generator::new(7);
    let x = Tensor::randn(&[8, 3, 16, 16], 0.5, 2.0, DType::F32, &mut gen).unwrap();
    let w = Tensor::randn(&[8, 10], 0.0, 1.0, DType::F32, &mut gen).unwrap();
    let mut m = hemi::models::resnet20(10, &mut Generator::new(3)).unwrap();
    let reducer = sync.as_ref().map(|g| {
        assert_eq!(hemi::dist::convert_sync_batch_norm(&mut m, g), 19);
        GradReducer::new(g.clone(), m.parameters(), ReducerConfig::default()).unwrap()
    });
    let n = rows.len();
    let (x, w) = (
        x.narrow(0, rows.start, n).unwrap(),
        w.narrow(0, rows.start, n).unwrap(),
    );
    let loss = m
        .forward(&x)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .div_scalar(n as f64)
        .unwrap();
    loss.backward().unwrap();
    if let Some(r) = reducer {
        r.finish().unwrap();
    }
    let grads = m
        .parameters()
        .iter()
        .map(|p| p.grad().unwrap().to_vec_f32())
        .collect();
    (grads, m.bn1.running_var.to_vec_f32())
}

fn rel_dist(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut d, mut s) = (0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        d += x
            .iter()
            .zip(y)
            .map(|(p, q)| f64::from(p - q).powi(2))
            .sum::<f64>();
        s += y.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>();
    }
    (d / s).sqrt()
}

#[test]
fn sync_batch_norm_on_two_ranks_equals_one_rank_with_the_whole_batch() {
    let (want, want_rv) = resnet_step(None, 0..8);
    let got = on_ranks(2, Duration::from_secs(60), |g| {
        let r = g.rank();
        resnet_step(Some(g), 4 * r..4 * r + 4)
    });
    // Per-rank statistics (no sync) give other gradients: the check below can tell.
    let per_rank = on_ranks(2, Duration::from_secs(60), |g| {
        let r = g.rank();
        let (grads, _) = resnet_step(None, 4 * r..4 * r + 4);
        let mean: Vec<Vec<f32>> = grads
            .into_iter()
            .map(|v| {
                g.all_reduce(v, Wire::F32)
                    .unwrap()
                    .wait()
                    .unwrap()
                    .into_iter()
                    .map(|x| x / 2.0)
                    .collect()
            })
            .collect();
        mean
    });
    let unsynced = rel_dist(&per_rank[0], &want);
    for (r, (grads, rv)) in got.iter().enumerate() {
        let d = rel_dist(grads, &want);
        // The same sums in another order: F32 rounding through 20 layers (measured 8.6e-7;
        // per-rank statistics: 0.63).
        assert!(d < 1e-5, "rank {r}: SyncBatchNorm gradients off by {d:e}");
        assert!(
            unsynced > 100.0 * d,
            "per-rank BN ({unsynced:e}) is no farther than SyncBN ({d:e})"
        );
        let dv = rel_dist(std::slice::from_ref(rv), std::slice::from_ref(&want_rv));
        assert!(dv < 1e-5, "rank {r}: running_var off by {dv:e}");
    }
    assert_eq!(got[0].0, got[1].0, "the ranks' averaged gradients differ");
}

/// `ranks` threads train the MLP one epoch with ZeRO stage `zero`; every rank's final
/// parameters (and summary), in rank order.
fn zero_run(cfg: TrainConfig, ranks: usize, zero: ZeroStage) -> Vec<(Vec<Vec<f32>>, Summary)> {
    on_ranks(ranks, Duration::from_secs(120), move |g| {
        let mut m = mlp();
        let shard = Shard {
            rank: g.rank(),
            world: ranks,
            pad: true,
        };
        let (tr, te) = loaders_n(shard, 16, 192);
        let cfg = TrainConfig {
            epochs: 1,
            dist: Some(DistConfig {
                group: g,
                // Small buckets: chunk boundaries cut parameters (the first layer's weight,
                // 73,728 values, is a bucket of its own; the rest share buckets).
                reducer: ReducerConfig {
                    wire: Wire::F32,
                    bucket_bytes: 16 << 10,
                },
                zero,
            }),
            ..cfg.clone()
        };
        let s = train(&mut m, &tr, &te, &cfg, &info(cfg.precision), &mut |_| {}).unwrap();
        (params_of(&m), s)
    })
}

/// The recipes the ZeRO tests run: momentum SGD in fp32, Adam under amp-fp16 with its loss
/// scaler and clipping, AdamW under fp16-master (F16 weights, F32 masters of the shard)
/// with clipping, SGD under amp-bf16 with clipping.
fn zero_recipes() -> Vec<(&'static str, TrainConfig)> {
    let adam = |precision, optimizer, clip| TrainConfig {
        optimizer,
        lr: 1e-3,
        clip_grad_norm: clip,
        ..base(precision)
    };
    vec![
        ("fp32 sgd", base(Precision::Fp32)),
        (
            "amp-fp16 adam clip",
            adam(Precision::AmpFp16, OptimizerKind::Adam, Some(0.5)),
        ),
        (
            "fp16-master adamw clip",
            adam(Precision::Fp16Master, OptimizerKind::AdamW, Some(0.5)),
        ),
        (
            "amp-bf16 sgd clip",
            TrainConfig {
                clip_grad_norm: Some(0.25),
                ..base(Precision::AmpBf16)
            },
        ),
    ]
}

#[test]
fn zero_stages_1_and_2_train_bit_identical_to_plain_data_parallel() {
    for ranks in [2, 3] {
        for (name, cfg) in zero_recipes() {
            let plain = zero_run(cfg.clone(), ranks, ZeroStage::Off);
            let want = bits(&plain[0].0);
            for zero in [ZeroStage::One, ZeroStage::Two] {
                for (r, (p, s)) in zero_run(cfg.clone(), ranks, zero).iter().enumerate() {
                    assert_eq!(
                        bits(p),
                        want,
                        "{name}, {ranks} ranks, {zero:?}: rank {r}'s parameters differ from \
                         plain data parallel"
                    );
                    assert_eq!(s.steps, plain[0].1.steps);
                    assert_eq!(s.skipped_steps, plain[0].1.skipped_steps);
                    assert_eq!(s.final_scale, plain[0].1.final_scale);
                }
            }
        }
    }
}

#[test]
fn clipping_in_the_zero_tests_changes_the_weights() {
    // Else the bit-identity above would not test the sharded norm.
    for (name, cfg) in zero_recipes() {
        if cfg.clip_grad_norm.is_none() {
            continue;
        }
        let clipped = zero_run(cfg.clone(), 2, ZeroStage::Two);
        let free = zero_run(
            TrainConfig {
                clip_grad_norm: None,
                ..cfg
            },
            2,
            ZeroStage::Two,
        );
        assert_ne!(bits(&clipped[0].0), bits(&free[0].0), "{name}");
    }
}

#[test]
fn zero_refuses_pure_bf16_and_gradient_statistics() {
    let errs = on_ranks(2, Duration::from_secs(60), |g| {
        let mut m = mlp();
        let shard = Shard {
            rank: g.rank(),
            world: 2,
            pad: true,
        };
        let (tr, te) = loaders_n(shard, 16, 64);
        let dist = DistConfig {
            group: g,
            reducer: ReducerConfig::default(),
            zero: ZeroStage::Two,
        };
        let mut out = Vec::new();
        for cfg in [
            TrainConfig {
                dist: Some(dist.clone()),
                ..base(Precision::PureBf16)
            },
            TrainConfig {
                dist: Some(dist.clone()),
                grad_stats: true,
                ..base(Precision::Fp32)
            },
        ] {
            let e = train(&mut m, &tr, &te, &cfg, &info(cfg.precision), &mut |_| {});
            out.push(e.err().map(|e| e.to_string()).unwrap_or_default());
        }
        out
    });
    assert!(errs[0][0].contains("pure-bf16"), "{:?}", errs[0]);
    assert!(errs[0][1].contains("ZeRO"), "{:?}", errs[0]);
}
