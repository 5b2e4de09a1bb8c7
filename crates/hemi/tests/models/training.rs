//! End-to-end: a two-layer MLP and a small CNN, built from hemi ops with plain SGD written
//! here, learn synthetic problems in F32 (their loss falls well below its start).

use hemi::ops::conv::Conv2dOptions;
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::{no_grad, DType, Generator, Result, Tensor};

fn sgd_step(params: &[Tensor], lr: f64) -> Result<()> {
    let _g = no_grad();
    for p in params {
        let g = p.grad().expect("every parameter gets a gradient");
        p.set_data(&p.sub(&g.mul_scalar(lr)?)?)?;
        p.zero_grad();
    }
    Ok(())
}

fn uniform_param(shape: &[usize], fan_in: usize, rng: &mut Generator) -> Tensor {
    let b = 1.0 / (fan_in as f64).sqrt();
    Tensor::rand(shape, -b, b, DType::F32, rng)
        .unwrap()
        .requires_grad_()
}

/// Labels from a fixed random teacher: class = argmax of a random linear map of x.
fn teacher_problem(n: usize, d: usize, classes: usize, rng: &mut Generator) -> (Tensor, Tensor) {
    let x = Tensor::randn(&[n, d], 0.0, 1.0, DType::F32, rng).unwrap();
    let w: Vec<f64> = (0..d * classes).map(|_| rng.normal()).collect();
    let xv = x.to_vec_f64();
    let labels: Vec<i64> = (0..n)
        .map(|i| {
            let scores: Vec<f64> = (0..classes)
                .map(|c| {
                    (0..d)
                        .map(|k| xv[i * d + k] * w[k * classes + c])
                        .sum::<f64>()
                })
                .collect();
            (0..classes)
                .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
                .unwrap() as i64
        })
        .collect();
    (x, Tensor::from_vec(labels, &[n]).unwrap())
}

#[test]
fn two_layer_mlp_learns() {
    let mut rng = Generator::new(11);
    let (x, y) = teacher_problem(256, 10, 4, &mut rng);
    let w1 = uniform_param(&[32, 10], 10, &mut rng);
    let b1 = uniform_param(&[32], 10, &mut rng);
    let w2 = uniform_param(&[4, 32], 32, &mut rng);
    let b2 = uniform_param(&[4], 32, &mut rng);
    let params = [w1.clone(), b1.clone(), w2.clone(), b2.clone()];
    let mut losses = Vec::new();
    for _ in 0..150 {
        let h = x.linear(&w1, Some(&b1)).unwrap().relu().unwrap();
        let logits = h.linear(&w2, Some(&b2)).unwrap();
        let loss = cross_entropy(&logits, &y, CrossEntropyOptions::default()).unwrap();
        losses.push(loss.to_scalar().unwrap());
        loss.backward().unwrap();
        sgd_step(&params, 0.5).unwrap();
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(first > 1.0, "starts near ln 4: {first}");
    assert!(last < 0.35 * first, "loss {first} -> {last}");
}

#[test]
fn small_cnn_learns() {
    // 8x8 single-channel images: class 0 has a bright horizontal bar, class 1 a vertical
    // one, at random positions, plus noise. A conv + pool + linear net must find them.
    let mut rng = Generator::new(12);
    let n = 64;
    let mut img = vec![0.0f64; n * 64];
    let mut labels = Vec::new();
    for i in 0..n {
        let class = (i % 2) as i64;
        let pos = 1 + rng.below(6) as usize;
        for p in 0..64 {
            img[i * 64 + p] = 0.3 * rng.normal();
        }
        for t in 1..7 {
            let (r, c) = if class == 0 { (pos, t) } else { (t, pos) };
            img[i * 64 + r * 8 + c] += 1.5;
        }
        labels.push(class);
    }
    let x = Tensor::from_f64_vec(img, &[n, 1, 8, 8], DType::F32).unwrap();
    let y = Tensor::from_vec(labels, &[n]).unwrap();
    let wc = uniform_param(&[4, 1, 3, 3], 9, &mut rng);
    let bc = uniform_param(&[4], 9, &mut rng);
    let wf = uniform_param(&[2, 4 * 3 * 3], 36, &mut rng);
    let bf = uniform_param(&[2], 36, &mut rng);
    let params = [wc.clone(), bc.clone(), wf.clone(), bf.clone()];
    let mut losses = Vec::new();
    for _ in 0..60 {
        let h = x
            .conv2d(&wc, Some(&bc), Conv2dOptions::default())
            .unwrap()
            .relu()
            .unwrap(); // [n,4,6,6]
        let h = h
            .max_pool2d((2, 2), (2, 2), (0, 0))
            .unwrap()
            .flatten(1, -1)
            .unwrap(); // [n,36]
        let logits = h.linear(&wf, Some(&bf)).unwrap();
        let loss = cross_entropy(&logits, &y, CrossEntropyOptions::default()).unwrap();
        losses.push(loss.to_scalar().unwrap());
        loss.backward().unwrap();
        sgd_step(&params, 0.2).unwrap();
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < 0.3 * first, "loss {first} -> {last}");
}
