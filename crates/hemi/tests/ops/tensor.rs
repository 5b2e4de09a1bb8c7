//! Tensor creation, reading back, casts and the dtype table.

use half::{bf16, f16};
use hemi::{DType, Generator, Tensor};

#[test]
fn creation_and_read_back() {
    let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    assert!(t.to_vec::<f16>().is_err());
    assert!(Tensor::from_vec(vec![1.0f32; 5], &[2, 3]).is_err());
    let h = Tensor::from_vec(vec![f16::from_f32(1.5), f16::from_f32(-2.0)], &[2]).unwrap();
    assert_eq!(h.dtype(), DType::F16);
    assert_eq!(h.to_vec_f64(), vec![1.5, -2.0]);
    let b = Tensor::from_vec(vec![bf16::from_f32(3.0)], &[1, 1]).unwrap();
    assert_eq!(b.to_scalar().unwrap(), 3.0);
    assert_eq!(
        Tensor::full(&[2, 2], 7.0, DType::BF16)
            .unwrap()
            .to_vec_f64(),
        vec![7.0; 4]
    );
    assert_eq!(Tensor::zeros(&[0, 3], DType::F16).unwrap().numel(), 0);
    assert_eq!(
        Tensor::arange(1.0, 2.0, 0.25, DType::F32)
            .unwrap()
            .to_vec_f64(),
        vec![1.0, 1.25, 1.5, 1.75]
    );
    assert!(Tensor::arange(0.0, 1.0, 0.0, DType::F32).is_err());
    assert_eq!(Tensor::scalar(2.5, DType::F16).shape(), &[] as &[usize]);
}

#[test]
fn seeded_random_tensors_repeat() {
    let a = Tensor::randn(&[100], 0.0, 1.0, DType::F32, &mut Generator::new(7)).unwrap();
    let b = Tensor::randn(&[100], 0.0, 1.0, DType::F32, &mut Generator::new(7)).unwrap();
    let c = Tensor::randn(&[100], 0.0, 1.0, DType::F32, &mut Generator::new(8)).unwrap();
    assert_eq!(a.to_vec_f64(), b.to_vec_f64());
    assert_ne!(a.to_vec_f64(), c.to_vec_f64());
    let n = 20_000;
    let u = Tensor::rand(&[n], -1.0, 3.0, DType::F64, &mut Generator::new(1))
        .unwrap()
        .to_vec_f64();
    assert!(u.iter().all(|&x| (-1.0..3.0).contains(&x)));
    let mean = u.iter().sum::<f64>() / n as f64;
    // Standard error of the mean of U(-1, 3) is (4/sqrt(12))/sqrt(n) ~ 0.008; allow 5 sigma.
    assert!((mean - 1.0).abs() < 0.04, "{mean}");
    let r = Tensor::randn(&[n], 2.0, 0.5, DType::F64, &mut Generator::new(2))
        .unwrap()
        .to_vec_f64();
    let m = r.iter().sum::<f64>() / n as f64;
    let var = r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n as f64;
    assert!(
        (m - 2.0).abs() < 0.02 && (var - 0.25).abs() < 0.02,
        "{m} {var}"
    );
    let l = Tensor::randint(&[1000], 10, &mut Generator::new(3))
        .unwrap()
        .to_vec_i64();
    assert!(l.iter().all(|&x| (0..10).contains(&x)));
    assert!(Tensor::rand(&[2], 1.0, 0.0, DType::F32, &mut Generator::new(0)).is_err());
}

#[test]
fn casts_round_to_nearest_even_and_keep_specials() {
    let v = vec![
        1.0 + 2f64.powi(-11),
        65520.0,
        -1e-9,
        f64::NAN,
        f64::NEG_INFINITY,
        0.1,
    ];
    let t = Tensor::from_f64_vec(v.clone(), &[6], DType::F32).unwrap();
    let h = t.to_dtype(DType::F16).unwrap().to_vec_f64();
    assert_eq!(h[0], 1.0, "tie rounds to even");
    assert_eq!(h[1], f64::INFINITY, "65520 overflows F16");
    assert_eq!(h[2], 0.0);
    assert!(h[2].is_sign_negative());
    assert!(h[3].is_nan());
    assert_eq!(h[4], f64::NEG_INFINITY);
    assert_eq!(h[5], f64::from(f16::from_f32(0.1).to_f32()));
    let b = t.to_dtype(DType::BF16).unwrap().to_vec_f64();
    assert_eq!(b[5], f64::from(bf16::from_f32(0.1).to_f32()));
    // Casting a strided view casts the viewed elements.
    let m = Tensor::arange(0.0, 6.0, 1.0, DType::F32)
        .unwrap()
        .reshape(&[2, 3])
        .unwrap();
    let c = m.t().unwrap().to_dtype(DType::BF16).unwrap();
    assert_eq!(c.shape(), &[3, 2]);
    assert_eq!(c.to_vec_f64(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    // I64 round trip and truncation.
    let i = Tensor::from_f64_vec(vec![2.7, -1.2], &[2], DType::F32)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap();
    assert_eq!(i.to_vec_i64(), vec![2, -1]);
}

#[test]
fn half_tensors_take_half_the_memory() {
    let f = Tensor::zeros(&[1000], DType::F32).unwrap();
    let h = f.to_dtype(DType::F16).unwrap();
    assert_eq!(f.storage().size_in_bytes(), 4000);
    assert_eq!(h.storage().size_in_bytes(), 2000);
    assert_eq!(DType::BF16.size_in_bytes(), 2);
}

/// Shape products are checked: a shape whose element count overflows (or whose bytes would
/// not fit in memory's address range) is an error naming the op, never a wrapped size.
#[test]
fn overflowing_shapes_are_errors() {
    let huge = [1usize << 32, 1 << 32];
    for r in [
        Tensor::zeros(&huge, DType::F32),
        Tensor::full(&[usize::MAX, 2], 1.0, DType::F16),
        Tensor::rand(&huge, 0.0, 1.0, DType::F32, &mut hemi::Generator::new(0)),
        Tensor::randn(&huge, 0.0, 1.0, DType::F32, &mut hemi::Generator::new(0)),
        Tensor::randint(&huge, 3, &mut hemi::Generator::new(0)),
        Tensor::from_vec(vec![0f32; 4], &[1 << 63, 2, 2]),
        Tensor::zeros(&[4], DType::F32).and_then(|t| t.reshape(&[1 << 62, 4])),
    ] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("too many elements"), "{e}");
    }
    // 2^61 elements wrap nothing in usize but are 2^64 bytes at 8 per element.
    let e = Tensor::zeros(&[1 << 61], DType::F64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("too many elements"), "{e}");
}

#[test]
fn devices_are_real_and_cuda_without_its_backend_is_an_error() {
    use hemi::nn::Module;
    use hemi::Device;
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    assert_eq!(x.device(), Device::Cpu);
    // Moving to where it already is returns the same handle.
    assert!(x.to_device(Device::Cpu).unwrap().same_storage(&x));
    let mut rng = Generator::new(1);
    let mut net = hemi::models::Mlp::new(4, 3, 2, &mut rng).unwrap();
    let e = x
        .t()
        .unwrap()
        .to_device(Device::Cuda(0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cuda:0") && e.contains("--features cuda"), "{e}");
    let before: Vec<Vec<f32>> = net.parameters().iter().map(|p| p.to_vec_f32()).collect();
    let e = net.to_device(Device::Cuda(1)).unwrap_err().to_string();
    assert!(e.contains("cuda:1"), "{e}");
    net.to_device(Device::Cpu).unwrap();
    let after: Vec<Vec<f32>> = net.parameters().iter().map(|p| p.to_vec_f32()).collect();
    assert_eq!(before, after);
    assert!(net.parameters().iter().all(|p| p.device() == Device::Cpu));
}
