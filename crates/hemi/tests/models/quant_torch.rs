//! hemi's INT8 arithmetic against PyTorch's, bit for bit: the fixture
//! `fixtures/quant/torch_quant.json` holds PyTorch's results on inputs chosen for their
//! edges (`bench/quant_fixtures.py` records it and documents each case).

use std::path::PathBuf;

use hemi::cpu::qgemm::quant as k;
use hemi::quant::{fake_quant_ste, Observer, ObserverKind, QDType, QData, QTensor};
use hemi::Tensor;
use serde_json::Value;

fn fixture() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant/torch_quant.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
        .collect()
}
fn ints(v: &Value) -> Vec<i32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_i64().unwrap() as i32)
        .collect()
}
fn one(v: &Value) -> f32 {
    f32::from_bits(v.as_u64().unwrap() as u32)
}

/// Distance in units in the last place.
fn ulps(a: f32, b: f32) -> u32 {
    let key = |x: f32| {
        let b = x.to_bits() as i32;
        if b < 0 {
            i32::MIN - b
        } else {
            b
        }
    };
    key(a).abs_diff(key(b))
}

#[test]
fn quantize_per_tensor_matches_pytorch_bit_for_bit() {
    let f = fixture();
    let mut n = 0;
    for case in f["per_tensor"].as_array().unwrap() {
        let scale = one(&case["scale"]);
        let zp = case["zero_point"].as_i64().unwrap() as i32;
        let x = f32s(&case["x"]);
        let want = ints(&case["q"]);
        let dtype = if case["dtype"] == "u8" {
            QDType::U8
        } else {
            QDType::I8
        };
        let t = Tensor::from_vec(x.clone(), &[x.len()]).unwrap();
        let q = QTensor::quantize_per_tensor(&t, scale, zp, dtype).unwrap();
        let got: Vec<i32> = match q.data() {
            QData::U8(v) => v.iter().map(|&c| c as i32).collect(),
            QData::I8(v) => v.iter().map(|&c| c as i32).collect(),
        };
        let (qmin, qmax) = dtype.range();
        let mut overflow = 0;
        for i in 0..x.len() {
            if (x[i] as f64 / scale as f64).abs() >= 2f64.powi(31) {
                // Beyond ±2³¹ steps PyTorch's float-to-int conversion overflows (+inf and
                // 3.4e38 come out as qmin, say); hemi saturates, as the issue asks.
                let sat = if x[i] > 0.0 { qmax } else { qmin };
                assert_eq!(got[i], sat, "x {:e} must saturate", x[i]);
                overflow += 1;
                continue;
            }
            assert_eq!(got[i], want[i], "x {:e} scale {scale:e} zp {zp}", x[i]);
        }
        assert!(
            overflow < 10,
            "{overflow} values beyond the comparable range"
        );
        // Dequantise: hemi rounds (q - zp) · scale once; PyTorch's vector path computes
        // fma(q, scale, -zp · scale), which may differ by one ulp where zp != 0.
        let deq = q.dequantize().unwrap().to_vec_f32();
        let want_deq = f32s(&case["dequantized"]);
        let mut off = 0;
        for i in 0..x.len() {
            if (x[i] as f64 / scale as f64).abs() >= 2f64.powi(31) {
                continue;
            }
            let u = ulps(deq[i], want_deq[i]);
            assert!(
                u <= 1,
                "dequantize {}: {} vs {}",
                got[i],
                deq[i],
                want_deq[i]
            );
            off += (u > 0) as usize;
            if zp == 0 {
                assert_eq!(u, 0, "zero point 0 must be exact");
            }
        }
        assert!(off * 10 <= x.len(), "{off} of {} one ulp off", x.len());
        n += x.len();
    }
    assert!(n > 5000);
}

#[test]
fn weights_quantise_per_channel_as_pytorch() {
    let f = fixture();
    let c = &f["per_channel"];
    let shape: Vec<usize> = c["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let w = Tensor::from_vec(f32s(&c["x"]), &shape).unwrap();
    let q = QTensor::quantize_weight(&w).unwrap();
    let scales = f32s(&c["scales"]);
    assert_eq!(
        q.scales().iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        scales.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        "per-channel scales"
    );
    assert!(ints(&c["zero_points"]).iter().all(|&z| z == 0));
    let got: Vec<i32> = q.as_i8().unwrap().iter().map(|&v| v as i32).collect();
    assert_eq!(got, ints(&c["q"]));
}

#[test]
fn observers_give_pytorchs_qparams() {
    let f = fixture();
    for (name, kind) in [
        ("minmax", ObserverKind::MinMax),
        ("minmax_positive", ObserverKind::MinMax),
        ("moving_average", ObserverKind::MovingAverage(0.01)),
    ] {
        let c = &f[name];
        let mut o = Observer::new(kind);
        for b in c["batches"].as_array().unwrap() {
            o.observe(&f32s(b));
        }
        let (lo, hi) = o.range();
        assert_eq!(
            (lo.to_bits(), hi.to_bits()),
            (
                c["min"].as_u64().unwrap() as u32,
                c["max"].as_u64().unwrap() as u32
            ),
            "{name} range"
        );
        let (s, z) = o.qparams_u8();
        assert_eq!(
            s.to_bits(),
            c["scale"].as_u64().unwrap() as u32,
            "{name} scale {s}"
        );
        assert_eq!(
            z as i64,
            c["zero_point"].as_i64().unwrap(),
            "{name} zero point"
        );
        let (s2, z2) = k::affine_qparams(lo, hi, 0, 255);
        assert_eq!((s2, z2), (s, z));
    }
}

#[test]
fn fake_quantize_and_its_gradient_match_pytorch() {
    let f = fixture();
    let c = &f["fake_quant"];
    let (scale, zp) = (one(&c["scale"]), c["zero_point"].as_i64().unwrap() as i32);
    let xs = f32s(&c["x"]);
    let x = Tensor::from_vec(xs.clone(), &[xs.len()])
        .unwrap()
        .requires_grad_();
    let w = Tensor::from_vec(f32s(&c["w"]), &[xs.len()]).unwrap();
    let y = fake_quant_ste(&x, scale, zp).unwrap();
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let want_y = f32s(&c["y"]);
    // hemi's forward is clamp(x) + (fq(x) - clamp(x)): equal to PyTorch's fq(x) up to one
    // F32 rounding of that sum.
    for (i, (a, b)) in y.to_vec_f32().iter().zip(&want_y).enumerate() {
        assert!(
            ulps(*a, *b) <= 1 || (a - b).abs() <= f32::MIN_POSITIVE,
            "[{i}] x {} -> {a} vs {b}",
            xs[i]
        );
    }
    let g = x.grad().unwrap().to_vec_f32();
    let want_g = f32s(&c["grad"]);
    // Equal values (a blocked gradient is w · 0 in hemi, -0 for negative w, where
    // PyTorch's mask gives +0).
    for i in 0..xs.len() {
        assert_eq!(
            g[i],
            want_g[i],
            "gradient at x = {} ({:#x})",
            xs[i],
            xs[i].to_bits()
        );
    }
}
