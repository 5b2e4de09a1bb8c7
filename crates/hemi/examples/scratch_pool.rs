use hemi::dtype::DType;
use hemi::ops::conv::Conv2dOptions;
use hemi::tensor::Tensor;
use std::time::Instant;
fn main() {
    let mut g = hemi::rng::Generator::new(0);
    let x = Tensor::randn(&[128, 3, 32, 32], 0.0, 1.0, DType::F32, &mut g).unwrap();
    let w = Tensor::randn(&[64, 3, 3, 3], 0.0, 0.3, DType::F32, &mut g).unwrap();
    let x2 = Tensor::randn(&[128, 64, 15, 15], 0.0, 1.0, DType::F32, &mut g).unwrap();
    let w2 = Tensor::randn(&[128, 64, 3, 3], 0.0, 0.05, DType::F32, &mut g).unwrap();
    for _ in 0..5 {
        let t = Instant::now();
        let y = x
            .conv2d_relu_max_pool2(&w, None, Conv2dOptions::default())
            .unwrap();
        let t1 = t.elapsed();
        let t = Instant::now();
        let y2 = x2
            .conv2d_relu_max_pool2(&w2, None, Conv2dOptions::default())
            .unwrap();
        let t2 = t.elapsed();
        println!("block1 {:?} block2 {:?} {}", t1, t2, y.numel() + y2.numel());
    }
}
