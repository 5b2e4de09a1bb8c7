//! Layers: PyTorch naming and order, default initialisation, casts, state_dict loading,
//! and safetensors checkpoints.

use hemi::io::{from_safetensors_bytes, load_safetensors, save_safetensors, to_safetensors_bytes};
use hemi::models::{CifarNet, Mlp};
use hemi::nn::{BatchNorm2d, Conv2d, Flatten, Linear, Module, Relu, Sequential};
use hemi::ops::conv::Conv2dOptions;
use hemi::{DType, Generator, Tensor};

#[test]
fn cifar_net_has_pytorch_names_shapes_and_output() {
    let net = CifarNet::cifar10(&mut Generator::new(0)).unwrap();
    let names: Vec<(String, Vec<usize>)> = net
        .state_dict()
        .into_iter()
        .map(|(n, t)| (n, t.shape().to_vec()))
        .collect();
    let want: Vec<(String, Vec<usize>)> = vec![
        ("conv1.weight".into(), vec![64, 3, 3, 3]),
        ("conv1.bias".into(), vec![64]),
        ("conv2.weight".into(), vec![128, 64, 3, 3]),
        ("conv2.bias".into(), vec![128]),
        ("fc1.weight".into(), vec![256, 4608]),
        ("fc1.bias".into(), vec![256]),
        ("fc2.weight".into(), vec![10, 256]),
        ("fc2.bias".into(), vec![10]),
    ];
    assert_eq!(names, want);
    let x = Tensor::randn(
        &[2, 3, 32, 32],
        0.0,
        1.0,
        DType::F32,
        &mut Generator::new(1),
    )
    .unwrap();
    assert_eq!(net.forward(&x).unwrap().shape(), &[2, 10]);
    assert!(CifarNet::new(3, 8, 8, 10, &mut Generator::new(0)).is_err());
}

#[test]
fn default_init_is_uniform_within_one_over_sqrt_fan_in() {
    let l = Linear::new(400, 300, true, &mut Generator::new(3)).unwrap();
    let w = l.weight.to_vec_f64();
    let bound = 1.0 / 20.0;
    assert!(w.iter().all(|x| x.abs() <= bound));
    // The variance of U(-b, b) is b^2/3; 120,000 samples pin it to well within 3%.
    let var = w.iter().map(|x| x * x).sum::<f64>() / w.len() as f64;
    assert!((var / (bound * bound / 3.0) - 1.0).abs() < 0.03, "{var}");
    let c = Conv2d::new(
        6,
        8,
        (5, 5),
        Conv2dOptions::default(),
        true,
        &mut Generator::new(4),
    )
    .unwrap();
    let cb = 1.0 / (150f64).sqrt();
    assert!(c
        .bias
        .as_ref()
        .unwrap()
        .to_vec_f64()
        .iter()
        .all(|x| x.abs() <= cb));
    // Same seed, same weights.
    let l2 = Linear::new(400, 300, true, &mut Generator::new(3)).unwrap();
    assert_eq!(l2.weight.to_vec_f64(), w);
}

#[test]
fn sequential_names_and_batch_norm_buffers() {
    let mut rng = Generator::new(5);
    let mut net = Sequential::new()
        .add(
            Conv2d::new(
                3,
                4,
                (3, 3),
                Conv2dOptions::default().padding(1),
                false,
                &mut rng,
            )
            .unwrap(),
        )
        .add(BatchNorm2d::new(4).unwrap())
        .add(Relu)
        .add(Flatten)
        .add(Linear::new(4 * 5 * 5, 3, true, &mut rng).unwrap());
    let names: Vec<String> = net.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "0.weight",
            "1.weight",
            "1.bias",
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
            "4.weight",
            "4.bias"
        ]
    );
    assert_eq!(net.parameters().len(), 5);
    let x = Tensor::randn(&[6, 3, 5, 5], 1.0, 2.0, DType::F32, &mut rng).unwrap();
    net.forward(&x).unwrap();
    let sd = net.state_dict();
    assert_eq!(
        sd[5].1.to_vec_i64(),
        vec![1],
        "num_batches_tracked counts training steps"
    );
    assert!(
        sd[3].1.to_vec_f64().iter().any(|&m| m != 0.0),
        "running mean moved"
    );
    // In eval mode the running stats stay put.
    net.set_training(false);
    net.forward(&x).unwrap();
    assert_eq!(net.state_dict()[5].1.to_vec_i64(), vec![1]);
}

#[test]
fn half_cast_keeps_norms_f32_when_asked() {
    let mut rng = Generator::new(6);
    let mut net = Sequential::new()
        .add(Linear::new(4, 4, true, &mut rng).unwrap())
        .add(BatchNorm2d::new(4).unwrap());
    net.to_dtype(DType::F16, true).unwrap();
    let dt: Vec<DType> = net.state_dict().iter().map(|(_, t)| t.dtype()).collect();
    assert_eq!(
        dt,
        [
            DType::F16,
            DType::F16,
            DType::F32,
            DType::F32,
            DType::F32,
            DType::F32,
            DType::I64
        ]
    );
    assert!(net
        .parameters()
        .iter()
        .all(|p| p.requires_grad() && p.is_leaf()));
    net.to_dtype(DType::BF16, false).unwrap();
    assert_eq!(net.state_dict()[2].1.dtype(), DType::BF16);
}

#[test]
fn state_dict_round_trips_through_safetensors() {
    let net = Mlp::new(12, 7, 3, &mut Generator::new(7)).unwrap();
    let dir = std::env::temp_dir().join(format!("hemi-nn-test-{}", std::process::id()));
    let path = dir.join("model.safetensors");
    save_safetensors(&path, &net.state_dict(), None).unwrap();
    // No temporary file is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "{leftovers:?}");
    let (loaded, _) = load_safetensors(&path).unwrap();
    let mut other = Mlp::new(12, 7, 3, &mut Generator::new(8)).unwrap();
    let params_before = other.parameters();
    other.load_state_dict(&loaded).unwrap();
    for ((n, a), (_, b)) in net.state_dict().iter().zip(other.state_dict().iter()) {
        assert_eq!(a.to_vec_f64(), b.to_vec_f64(), "{n}");
    }
    // Loaded in place: the handles an optimizer holds see the new values.
    assert_eq!(
        params_before[0].to_vec_f64(),
        net.parameters()[0].to_vec_f64()
    );
    // Strictness: a missing key and a wrong shape are errors.
    assert!(other
        .load_state_dict(&loaded[1..])
        .unwrap_err()
        .to_string()
        .contains("missing key"));
    let mut wrong = loaded.clone();
    wrong.iter_mut().find(|(n, _)| n == "fc1.weight").unwrap().1 =
        Tensor::zeros(&[7, 11], DType::F32).unwrap();
    assert!(other
        .load_state_dict(&wrong)
        .unwrap_err()
        .to_string()
        .contains("fc1.weight"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn safetensors_keeps_every_dtype_and_rejects_corrupt_files() {
    let ts = vec![
        (
            "a".to_string(),
            Tensor::from_f64_vec(vec![1.5, -2.25, 3.0], &[3], DType::F16).unwrap(),
        ),
        (
            "b".to_string(),
            Tensor::from_f64_vec(vec![0.1; 6], &[2, 3], DType::BF16)
                .unwrap()
                .t()
                .unwrap(),
        ),
        (
            "c".to_string(),
            Tensor::from_vec(vec![7i64, -1], &[2]).unwrap(),
        ),
        (
            "d".to_string(),
            Tensor::from_f64_vec(vec![0.1], &[], DType::F32).unwrap(),
        ),
    ];
    let bytes = to_safetensors_bytes(&ts, None).unwrap();
    let (back, _) = from_safetensors_bytes("mem", &bytes).unwrap();
    assert_eq!(back.len(), ts.len());
    for (na, a) in &ts {
        let (_, b) = back.iter().find(|(nb, _)| nb == na).unwrap();
        assert_eq!(a.dtype(), b.dtype());
        assert_eq!(a.shape(), b.shape());
        assert_eq!(a.to_vec_f64(), b.to_vec_f64());
    }
    let e = from_safetensors_bytes("cut.safetensors", &bytes[..bytes.len() - 3]).unwrap_err();
    assert!(e.to_string().contains("cut.safetensors"), "{e}");
    assert!(from_safetensors_bytes("junk", b"12345678garbage").is_err());
    assert!(load_safetensors(std::path::Path::new("/nonexistent/x.safetensors")).is_err());
}
