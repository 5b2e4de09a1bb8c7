//! Results do not depend on the thread count (issue 11): every reduction splits its work
//! into chunks fixed by the shapes and adds the partial results in chunk order, so a run on
//! 1, 2, 3 or 4 rayon threads gives the same bits, and a run resumed with another
//! `--threads` continues bit-identically. PyTorch does not promise this.
//!
//! Each test runs the same computation inside pools of several sizes and compares the f32
//! (or f64) bits of every result with the one-thread run, naming the first that differs.
//! Sizes are odd and large enough that every parallel path splits its work.

use crate::common;
use std::sync::Arc;

use common::rand_tensor;
use hemi::amp::{AmpOptimizer, GradScalerConfig, Precision};
use hemi::cpu::gemm::blocked;
use hemi::cpu::gemm::select::Kernel;
use hemi::cpu::gemm::{matmul_into, MatRef};
use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
use hemi::dtype::WithDType;
use hemi::models::{CifarNet, Mlp};
use hemi::nn::Module;
use hemi::ops::conv::Conv2dOptions;
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::optim::{Optimizer, Sgd, SgdConfig};
use hemi::{DType, Generator, Tensor};

/// Named results, as bit patterns (f32 and narrower as f32 bits, f64 as f64 bits).
type Bits = Vec<(String, Vec<u64>)>;

fn bits_of(name: impl Into<String>, t: &Tensor) -> (String, Vec<u64>) {
    let v = if t.dtype() == DType::F64 {
        t.to_vec_f64().iter().map(|x| x.to_bits()).collect()
    } else {
        t.to_vec_f32()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect()
    };
    (name.into(), v)
}

/// `f()` inside a rayon pool of `threads` threads.
fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
        .install(f)
}

/// Runs `f` on each thread count and asserts that every result has the bits of the first
/// run; the message names the first result and element that differ.
#[track_caller]
fn assert_same_bits(what: &str, threads: &[usize], f: impl Fn() -> Bits + Sync) {
    let want = on_threads(threads[0], &f);
    assert!(!want.is_empty(), "{what}: nothing to compare");
    for &t in &threads[1..] {
        let got = on_threads(t, &f);
        assert_eq!(got.len(), want.len(), "{what}: result count");
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_eq!(g.len(), w.len(), "{what}: {name}: length");
            if let Some(i) = g.iter().zip(w).position(|(a, b)| a != b) {
                panic!(
                    "{what}: {name}[{i}] differs on {t} threads from {} thread(s): bits {:#x} \
                     vs {:#x}",
                    threads[0], g[i], w[i]
                );
            }
        }
    }
}

const THREADS: [usize; 4] = [1, 2, 3, 4];

/// A random output gradient for `y` (not all ones, which hides ordering through ties).
fn backward_random(y: &Tensor, seed: u64) {
    let mut rng = Generator::new(seed);
    let (g, _) = rand_tensor(y.shape(), y.dtype(), false, &mut rng);
    hemi::autograd::backward_with(y, g).unwrap();
}

fn leaf(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    rand_tensor(shape, dtype, false, &mut Generator::new(seed))
        .0
        .requires_grad_()
}

// ----- whole training runs -------------------------------------------------------------------

/// Trains `model` for `steps` SGD steps (momentum 0.9) under `precision` on synthetic
/// images (batch `batch`, a loader without worker threads) and returns its parameters.
fn train_params(model: &mut dyn Module, precision: Precision, batch: usize, steps: usize) -> Bits {
    let data = Arc::new(Synthetic::generate(11, Split::Train, batch * steps));
    let loader = DataLoader::new(
        data,
        LoaderConfig {
            batch_size: batch,
            shuffle: true,
            seed: 3,
            workers: 0,
            transform: Transform::to_tensor_normalize_half(),
            ..Default::default()
        },
    )
    .unwrap();
    precision.prepare_model(model).unwrap();
    // A small initial loss scale, so that the first amp-fp16 steps are not skipped for
    // overflow (a skipped step would compare nothing).
    let scaler = GradScalerConfig {
        init_scale: 256.0,
        ..Default::default()
    };
    let mut opt = AmpOptimizer::new(precision, model.parameters(), scaler, 0, |p| {
        let sgd = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        };
        Ok(Box::new(Sgd::new(p, sgd)?) as Box<dyn Optimizer>)
    })
    .unwrap();
    model.set_training(true);
    let mut stepped = 0;
    for batch in loader.epoch(0) {
        let batch = batch.unwrap();
        opt.zero_grad();
        let loss = {
            let _ac = precision.autocast();
            let logits = model
                .forward(&precision.input(batch.images().unwrap()).unwrap())
                .unwrap();
            cross_entropy(&logits, &batch.labels, CrossEntropyOptions::default()).unwrap()
        };
        opt.backward(&loss).unwrap();
        stepped += usize::from(opt.step().unwrap());
    }
    assert!(stepped > 0, "{precision}: every step was skipped");
    model
        .named_parameters()
        .iter()
        .map(|(n, t)| bits_of(n.as_str(), t))
        .collect()
}

const PRESETS: [Precision; 6] = Precision::ALL;

#[test]
fn cifar_net_training_is_bit_identical_on_1_2_3_threads() {
    for precision in PRESETS {
        assert_same_bits(&format!("CifarNet {precision}"), &[1, 2, 3], || {
            let mut net = CifarNet::cifar10(&mut Generator::new(5)).unwrap();
            train_params(&mut net, precision, 19, 3)
        });
    }
}

#[test]
fn mlp_training_is_bit_identical_on_1_2_3_threads() {
    for precision in PRESETS {
        assert_same_bits(&format!("MLP {precision}"), &[1, 2, 3], || {
            let mut net = Mlp::new(3 * 32 * 32, 67, 10, &mut Generator::new(5)).unwrap();
            train_params(&mut net, precision, 37, 3)
        });
    }
}

// ----- single ops ----------------------------------------------------------------------------

const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

#[test]
fn sum_and_mean_are_bit_identical_across_thread_counts() {
    for dtype in DTYPES {
        assert_same_bits(&format!("sum/mean {dtype:?}"), &THREADS, || {
            let x = leaf(&[37, 9, 1001], dtype, 1);
            let all = x.sum_all().unwrap();
            let rows = x.sum(&[-1], false).unwrap();
            let cols = x.mean(&[0, 2], true).unwrap();
            let batch = x.sum(&[0], false).unwrap();
            let var = x.var(&[0, 1], 1, false).unwrap();
            let y = rows
                .sum_all()
                .unwrap()
                .add(&cols.sum_all().unwrap())
                .unwrap();
            let y = y.add(&batch.mean_all().unwrap()).unwrap();
            backward_random(&y.add(&var.sum_all().unwrap()).unwrap(), 2);
            vec![
                bits_of("sum_all", &all),
                bits_of("sum(-1)", &rows),
                bits_of("mean(0, 2)", &cols),
                bits_of("sum(0)", &batch),
                bits_of("var", &var),
                bits_of("dx", &x.grad().unwrap()),
            ]
        });
    }
}

/// Dropout decides its elements in parallel (one draw from the generator, then a
/// counter-based hash per element): the mask and the gradient are the same on any number of
/// threads, over many parallel chunks; a second call on the same generator draws another
/// mask.
#[test]
fn dropout_is_bit_identical_across_thread_counts() {
    for dtype in DTYPES {
        assert_same_bits(&format!("dropout {dtype:?}"), &THREADS, || {
            let x = leaf(&[5, 41_003], dtype, 3);
            let mut rng = Generator::new(8);
            let y = x.dropout(0.3, true, &mut rng).unwrap();
            let z = x.dropout(0.3, true, &mut rng).unwrap();
            assert_ne!(y.to_vec_f32(), z.to_vec_f32(), "the generator advances");
            backward_random(&y, 4);
            vec![bits_of("y", &y), bits_of("dx", &x.grad().unwrap())]
        });
    }
}

#[test]
fn matmul_with_large_k_is_bit_identical_across_thread_counts() {
    for dtype in DTYPES {
        assert_same_bits(&format!("matmul {dtype:?}"), &THREADS, || {
            let a = leaf(&[67, 4099], dtype, 3);
            let b = leaf(&[4099, 45], dtype, 4);
            let y = a.matmul(&b).unwrap();
            // Batched small products and a linear layer's shape (K = batch in dW).
            let p = leaf(&[7, 13, 301], dtype, 5);
            let q = leaf(&[7, 301, 11], dtype, 6);
            let z = p.matmul(&q).unwrap();
            backward_random(&y, 7);
            backward_random(&z, 8);
            vec![
                bits_of("a·b", &y),
                bits_of("da", &a.grad().unwrap()),
                bits_of("db", &b.grad().unwrap()),
                bits_of("p·q", &z),
                bits_of("dp", &p.grad().unwrap()),
                bits_of("dq", &q.grad().unwrap()),
            ]
        });
    }
}

#[test]
fn gemm_kernels_are_bit_identical_across_thread_counts() {
    let (m, k, n) = (131, 1543, 97);
    let mut rng = Generator::new(9);
    let a: Vec<f32> = (0..m * k).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let ah: Vec<half::f16> = a.iter().map(|&x| half::f16::from_f32(x)).collect();
    let bb: Vec<half::bf16> = b.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let ab: Vec<half::bf16> = a.iter().map(|&x| half::bf16::from_f32(x)).collect();
    // The `gemm` crate (F32), with a transposed operand.
    assert_same_bits("gemm crate", &THREADS, || {
        let mut c = vec![0f32; m * n];
        matmul_into(
            &mut c,
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&b, n, k).t(),
            false,
        );
        vec![(
            "c".into(),
            c.iter().map(|x| u64::from(x.to_bits())).collect(),
        )]
    });
    fn check<A: WithDType, B: WithDType>(
        kernel: Kernel,
        (m, k, n): (usize, usize, usize),
        a: &[A],
        b: &[B],
    ) {
        assert_same_bits(&format!("gemm_half {}", kernel.name()), &THREADS, || {
            let mut c = vec![0.5f32; m * n];
            let (am, bm) = (MatRef::row_major(a, m, k), MatRef::row_major(b, k, n));
            blocked::gemm_with(kernel, &mut c, am, bm, true, true);
            vec![(
                "c".into(),
                c.iter().map(|x| u64::from(x.to_bits())).collect(),
            )]
        });
    }
    for kernel in Kernel::ALL.into_iter().filter(|k| k.is_available()) {
        if kernel.accepts(DType::F16, DType::BF16) {
            check(kernel, (m, k, n), &ah, &bb);
        } else {
            check(kernel, (m, k, n), &ab, &bb);
        }
    }
}

#[test]
fn conv2d_forward_and_gradients_are_bit_identical_across_thread_counts() {
    let o = Conv2dOptions::default();
    for dtype in DTYPES {
        // 'Same' padding: BF16 weight gradients from the image in pixel pairs
        // (`cpu::conv::wgrad`), in runs (n = 9) and in parallel blocks of one image (n = 1).
        let same = o.padding(1);
        for (n, opts) in [
            (13, o),
            (7, o.stride(2).padding(1).groups(2)),
            (9, same),
            (1, same),
        ] {
            assert_same_bits(&format!("conv2d {dtype:?} n={n}"), &THREADS, || {
                let x = leaf(&[n, 6, 17, 15], dtype, 10);
                let w = leaf(&[10, 6 / opts.groups, 3, 3], dtype, 11);
                let b = leaf(&[10], dtype, 12);
                let y = x.conv2d(&w, Some(&b), opts).unwrap();
                backward_random(&y, 13);
                vec![
                    bits_of("y", &y),
                    bits_of("dx", &x.grad().unwrap()),
                    bits_of("dw", &w.grad().unwrap()),
                    bits_of("db", &b.grad().unwrap()),
                ]
            });
        }
    }
}

#[test]
fn conv_block_forward_and_gradients_are_bit_identical_across_thread_counts() {
    let o = Conv2dOptions::default();
    // CifarNet's second block (one image per GEMM), and small images (several per GEMM,
    // groups that do not divide the batch).
    for (x_shape, w_shape) in [
        ([11, 8, 15, 15], [12, 8, 3, 3]),
        ([23, 4, 8, 6], [6, 4, 3, 3]),
    ] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            assert_same_bits(&format!("block {dtype:?} {x_shape:?}"), &THREADS, || {
                let x = leaf(&x_shape, dtype, 20);
                let w = leaf(&w_shape, dtype, 21);
                let b = leaf(&[w_shape[0]], dtype, 22);
                let y = x.conv2d_relu_max_pool2(&w, Some(&b), o).unwrap();
                backward_random(&y, 23);
                vec![
                    bits_of("y", &y),
                    bits_of("dx", &x.grad().unwrap()),
                    bits_of("dw", &w.grad().unwrap()),
                    bits_of("db", &b.grad().unwrap()),
                ]
            });
        }
    }
}

#[test]
fn norms_are_bit_identical_across_thread_counts() {
    for dtype in DTYPES {
        assert_same_bits(&format!("batch_norm {dtype:?}"), &THREADS, || {
            let x = leaf(&[29, 7, 11, 13], dtype, 30);
            let w = leaf(&[7], DType::F32, 31);
            let b = leaf(&[7], DType::F32, 32);
            let y = x
                .batch_norm(None, None, Some(&w), Some(&b), true, 0.1, 1e-5)
                .unwrap();
            backward_random(&y, 33);
            vec![
                bits_of("y", &y),
                bits_of("dx", &x.grad().unwrap()),
                bits_of("dw", &w.grad().unwrap()),
                bits_of("db", &b.grad().unwrap()),
            ]
        });
        assert_same_bits(&format!("layer_norm {dtype:?}"), &THREADS, || {
            // Short rows, many of them: the parameters' gradients sum over 8003 rows.
            let x = leaf(&[8003, 37], dtype, 34);
            let w = leaf(&[37], dtype, 35);
            let b = leaf(&[37], dtype, 36);
            let y = x.layer_norm(&[37], Some(&w), Some(&b), 1e-5).unwrap();
            backward_random(&y, 37);
            vec![
                bits_of("y", &y),
                bits_of("dx", &x.grad().unwrap()),
                bits_of("dw", &w.grad().unwrap()),
                bits_of("db", &b.grad().unwrap()),
            ]
        });
    }
}

#[test]
fn cross_entropy_is_bit_identical_across_thread_counts() {
    for dtype in DTYPES {
        assert_same_bits(&format!("cross_entropy {dtype:?}"), &THREADS, || {
            let (rows, classes) = (2053, 37);
            let x = leaf(&[rows, classes], dtype, 40);
            let mut rng = Generator::new(41);
            let t: Vec<i64> = (0..rows)
                .map(|_| rng.below(classes as u64) as i64)
                .collect();
            let t = Tensor::from_vec(t, &[rows]).unwrap();
            let opts = CrossEntropyOptions {
                label_smoothing: 0.1,
                ..Default::default()
            };
            let loss = cross_entropy(&x, &t, opts).unwrap();
            loss.backward().unwrap();
            vec![bits_of("loss", &loss), bits_of("dx", &x.grad().unwrap())]
        });
    }
}
