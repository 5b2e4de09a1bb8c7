//! ResNet interop with PyTorch/torchvision: torchvision-named state_dicts load into hemi's
//! networks strictly and give PyTorch's eval-mode logits; hemi's state_dicts have exactly
//! torchvision's keys, order, shapes and dtypes (so torchvision's `load_state_dict(strict=
//! True)` takes them; `bench/resnet_interop_fixtures.py --check-hemi` does that for real).
//!
//! Fixtures (`tests/fixtures/resnet/`, written by `bench/resnet_interop_fixtures.py`, whose
//! docstring gives the layout):
//! - resnet20: the state_dict as `safetensors.torch.save_file` wrote it (F32 tensors, I64
//!   `num_batches_tracked` scalars), from the script's PyTorch mirror of hemi's option-A
//!   CIFAR network, and its logits on a 32×32 and a 33×33 batch;
//! - resnet18 (1000 classes, 57×57 input) and resnet50 (10 classes, 64×64): too large to
//!   commit, so their weights are exact F32 values from an integer hash that this file
//!   recomputes from a manifest of torchvision's state_dict (names, shapes, dtypes, the
//!   hash's parameters and a checksum per tensor); the inputs and logits are committed.
//!
//! PyTorch's logits are stored in F32 and in F64 (same weights cast to double). hemi runs in
//! F32 and must be within `tolerance` of both.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use hemi::io::{
    from_safetensors_bytes, load_safetensors, load_state_dict_strict, state_dict_mismatch,
    to_safetensors_bytes, NamedTensors,
};
use hemi::models::{resnet, ResNet};
use hemi::nn::Module;
use hemi::{DType, Generator, Tensor};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/resnet")
        .join(name)
}

fn load(name: &str) -> HashMap<String, Tensor> {
    let (tensors, _) = load_safetensors(&fixture(name)).unwrap();
    tensors.into_iter().collect()
}

// ----- the script's hashed weights -------------------------------------------------------

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser (the script's `mix`).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `2^e` as an F32, exactly (normal range only).
fn pow2(e: i64) -> f32 {
    assert!((-126..=127).contains(&e), "2^{e} is not a normal F32");
    f32::from_bits(((127 + e) as u32) << 23)
}

/// The script's `bits_hash`: `sum_i bits_i * (2i+1) * golden (mod 2^64)`.
fn bits_hash(bits: impl Iterator<Item = u64>) -> u64 {
    bits.enumerate().fold(0u64, |acc, (i, b)| {
        let m = (2 * i as u64 + 1).wrapping_mul(GOLDEN);
        acc.wrapping_add(b.wrapping_mul(m))
    })
}

/// A manifest's state_dict: (name, shape, dtype) in torchvision's order, and the tensors
/// recomputed from the hash (each checked against the script's checksum).
struct Manifest {
    arch: String,
    num_classes: usize,
    keys: Vec<(String, Vec<usize>, DType)>,
}

fn manifest(arch: &str) -> (Manifest, NamedTensors) {
    let text = std::fs::read_to_string(fixture(&format!("{arch}.json"))).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let seed = doc["seed"].as_u64().unwrap();
    let mut keys = Vec::new();
    let mut tensors = Vec::new();
    for (k, e) in doc["tensors"].as_array().unwrap().iter().enumerate() {
        let name = e["name"].as_str().unwrap().to_string();
        let shape: Vec<usize> = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let (bits, offset, exp) = (
            e["bits"].as_u64().unwrap(),
            e["offset"].as_i64().unwrap(),
            e["exp"].as_i64().unwrap(),
        );
        let n: usize = shape.iter().product();
        let q = (0..n as u64).map(|i| {
            let h = mix(seed ^ mix(((k as u64) << 32).wrapping_add(i)));
            offset + (h >> (64 - bits)) as i64 - (1i64 << (bits - 1))
        });
        let (t, hash, dtype) = match e["dtype"].as_str().unwrap() {
            "I64" => {
                let v: Vec<i64> = q.collect();
                let hash = bits_hash(v.iter().map(|&x| x as u64));
                (Tensor::from_vec(v, &shape).unwrap(), hash, DType::I64)
            }
            "F32" => {
                assert!(offset.unsigned_abs() + (1 << (bits - 1)) <= 1 << 24);
                let scale = pow2(exp);
                // |offset + u| <= 2^24: exact in F32, and so is the product by 2^exp.
                let v: Vec<f32> = q.map(|x| x as f32 * scale).collect();
                let hash = bits_hash(v.iter().map(|x| u64::from(x.to_bits())));
                (Tensor::from_vec(v, &shape).unwrap(), hash, DType::F32)
            }
            other => panic!("{name}: dtype {other}"),
        };
        assert_eq!(
            hash,
            e["hash"].as_u64().unwrap(),
            "{arch}: tensor {k} ({name}) differs from the script's"
        );
        keys.push((name.clone(), shape, dtype));
        tensors.push((name, t));
    }
    let m = Manifest {
        arch: doc["arch"].as_str().unwrap().to_string(),
        num_classes: doc["num_classes"].as_u64().unwrap() as usize,
        keys,
    };
    (m, tensors)
}

// ----- comparisons -----------------------------------------------------------------------

/// Weight layers (convs and fc) on the longest path through the network: the number of
/// F32 dot products an error passes through (6n+2 for the CIFAR nets, 18, 34, 50 for
/// torchvision's).
fn depth(arch: &str) -> usize {
    arch.trim_start_matches("resnet").parse().unwrap()
}

/// Allowed max |hemi - reference| over logits.
///
/// Each weight layer computes F32 dot products whose rounding (in either library's order
/// and blocking) is a few units of eps = 2^-23 relative to the layer's output scale; BN and
/// the residual additions keep activations on one scale, so the layer errors add as
/// independent terms: about eps · scale · sqrt(depth) at the logits, with scale the logits'
/// own max |logit|. We allow C = 16 times that (PyTorch's own F32 logits are within
/// 1.2–4.1 eps·max|logit| of its F64 ones on these fixtures, see the script's output):
///
///     tol = 16 · 2^-23 · max|logit| · sqrt(depth)
fn tolerance(arch: &str, logits_f64: &[f64]) -> f64 {
    let scale = logits_f64.iter().fold(0f64, |m, x| m.max(x.abs()));
    16.0 * f64::from(f32::EPSILON) * scale * (depth(arch) as f64).sqrt()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// hemi's eval-mode F32 logits for `x` against PyTorch's F32 and F64 ones.
fn check_logits(arch: &str, what: &str, net: &ResNet, x: &Tensor, t32: &Tensor, t64: &Tensor) {
    let got = {
        let _g = hemi::no_grad();
        net.forward(x).unwrap()
    };
    assert_eq!(got.dtype(), DType::F32);
    assert_eq!(got.shape(), t32.shape(), "{arch} {what}");
    let (got, r32, r64) = (got.to_vec_f64(), t32.to_vec_f64(), t64.to_vec_f64());
    let tol = tolerance(arch, &r64);
    let (d32, d64, torch_own) = (
        max_abs_diff(&got, &r32),
        max_abs_diff(&got, &r64),
        max_abs_diff(&r32, &r64),
    );
    let scale = r64.iter().fold(0f64, |m, x| m.max(x.abs()));
    let ulps = |d: f64| d / (f64::from(f32::EPSILON) * scale);
    eprintln!(
        "{arch} {what}: max|logit| {scale:.4}; max|hemi - torch f32| {d32:.3e} ({:.1} eps·max), \
         max|hemi - torch f64| {d64:.3e} ({:.1}), torch f32 vs f64 {torch_own:.3e} ({:.1}); \
         tolerance {tol:.3e} ({:.1})",
        ulps(d32),
        ulps(d64),
        ulps(torch_own),
        ulps(tol)
    );
    assert!(
        torch_own <= tol,
        "{arch} {what}: the fixture's own F32 error exceeds the bound"
    );
    assert!(
        d32 <= tol && d64 <= tol,
        "{arch} {what}: hemi's logits differ from PyTorch's by {d32:.3e} (F32 ref) / \
         {d64:.3e} (F64 ref) > {tol:.3e}"
    );
}

/// The names, shapes and dtypes of a state_dict, in order.
fn keys_of(state: &[(String, Tensor)]) -> Vec<(String, Vec<usize>, DType)> {
    state
        .iter()
        .map(|(n, t)| (n.clone(), t.shape().to_vec(), t.dtype()))
        .collect()
}

/// A torch-written state_dict in `state_dict()` order. A safetensors file keeps its tensors
/// sorted by dtype, then name, whatever order they were saved in; the script records
/// torchvision's order in the metadata ("state_dict_order").
fn ordered(file: &str) -> NamedTensors {
    let (tensors, meta) = load_safetensors(&fixture(file)).unwrap();
    let order: Vec<String> = serde_json::from_str(&meta["state_dict_order"]).unwrap();
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
    let out: NamedTensors = order
        .into_iter()
        .map(|n| {
            let t = by_name.remove(&n).unwrap();
            (n, t)
        })
        .collect();
    assert!(
        by_name.is_empty(),
        "not in state_dict_order: {:?}",
        by_name.keys()
    );
    out
}

/// `keys_of`, sorted by name: what survives a safetensors file.
fn sorted_keys(state: &[(String, Tensor)]) -> Vec<(String, Vec<usize>, DType)> {
    let mut k = keys_of(state);
    k.sort();
    k
}

/// Every tensor of `net` equals `state`'s by name, bit for bit (counters included).
fn assert_loaded(net: &ResNet, state: &[(String, Tensor)]) {
    let ours: HashMap<String, Tensor> = net.state_dict().into_iter().collect();
    for (name, t) in state {
        let o = &ours[name];
        assert_eq!(o.dtype(), t.dtype(), "{name}");
        match t.dtype() {
            DType::I64 => assert_eq!(o.to_vec_i64(), t.to_vec_i64(), "{name}"),
            _ => {
                let (a, b) = (o.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name}"
                );
            }
        }
    }
}

fn sorted_keys_of(keys: &[(String, Vec<usize>, DType)]) -> Vec<(String, Vec<usize>, DType)> {
    let mut k = keys.to_vec();
    k.sort();
    k
}

// ----- tests -----------------------------------------------------------------------------

#[test]
fn resnet20_torch_file_loads_strictly_and_gives_torchs_logits() {
    let state = ordered("resnet20.safetensors");
    // As torch saves it: F32 tensors, num_batches_tracked an I64 scalar.
    for (name, t) in &state {
        if name.ends_with("num_batches_tracked") {
            assert_eq!((t.dtype(), t.shape()), (DType::I64, &[][..]), "{name}");
        } else {
            assert_eq!(t.dtype(), DType::F32, "{name}");
        }
    }
    let mut net = resnet("resnet20", 10, &mut Generator::new(0)).unwrap();
    load_state_dict_strict(&mut net, &state).unwrap();
    assert_loaded(&net, &state);
    net.set_training(false);
    let io = load("resnet20_io.safetensors");
    check_logits(
        "resnet20",
        "32x32",
        &net,
        &io["x"],
        &io["logits"],
        &io["logits_f64"],
    );
    // 33×33: the option-A shortcut's x[:, :, ::2, ::2] keeps ceil(H/2) rows, as the strided
    // 3×3 conv does.
    check_logits(
        "resnet20",
        "33x33",
        &net,
        &io["x_odd"],
        &io["logits_odd"],
        &io["logits_odd_f64"],
    );
}

fn check_hashed(arch: &str) {
    let (m, state) = manifest(arch);
    assert_eq!(m.arch, arch);
    assert_eq!(keys_of(&state), m.keys);
    // Through hemi's safetensors writer and reader, as a checkpoint would travel (which
    // keeps names, shapes, dtypes and values, not the order).
    let bytes = to_safetensors_bytes(&state, None).unwrap();
    let (state, _) = from_safetensors_bytes(arch, &bytes).unwrap();
    assert_eq!(sorted_keys(&state), sorted_keys_of(&m.keys));
    let mut net = resnet(arch, m.num_classes, &mut Generator::new(0)).unwrap();
    load_state_dict_strict(&mut net, &state).unwrap();
    assert_loaded(&net, &state);
    net.set_training(false);
    let io = load(&format!("{arch}_io.safetensors"));
    let size = io["x"].shape()[2];
    check_logits(
        arch,
        &format!("{size}x{size}"),
        &net,
        &io["x"],
        &io["logits"],
        &io["logits_f64"],
    );
}

#[test]
fn resnet18_torchvision_weights_give_torchvisions_logits() {
    check_hashed("resnet18");
}

#[test]
fn resnet50_torchvision_weights_give_torchvisions_logits() {
    check_hashed("resnet50");
}

#[test]
fn hemi_state_dicts_have_torchvisions_keys_shapes_and_dtypes() {
    // What torchvision's load_state_dict(strict=True) checks (names and shapes), plus the
    // order and dtypes, which `safetensors.torch` round-trips.
    let mut rng = Generator::new(3);
    let r20 = resnet("resnet20", 10, &mut rng).unwrap();
    assert_eq!(
        keys_of(&r20.state_dict()),
        keys_of(&ordered("resnet20.safetensors"))
    );
    for arch in ["resnet18", "resnet50"] {
        let text = std::fs::read_to_string(fixture(&format!("{arch}.json"))).unwrap();
        let doc: Value = serde_json::from_str(&text).unwrap();
        let want: Vec<(String, Vec<usize>, DType)> = doc["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let shape = e["shape"].as_array().unwrap();
                (
                    e["name"].as_str().unwrap().to_string(),
                    shape.iter().map(|d| d.as_u64().unwrap() as usize).collect(),
                    if e["dtype"] == "I64" {
                        DType::I64
                    } else {
                        DType::F32
                    },
                )
            })
            .collect();
        let classes = doc["num_classes"].as_u64().unwrap() as usize;
        let net = resnet(arch, classes, &mut rng).unwrap();
        let sd = net.state_dict();
        assert_eq!(keys_of(&sd), want, "{arch}");
        // And hemi's safetensors writer + reader keep every name, shape and dtype.
        let bytes = to_safetensors_bytes(&sd, None).unwrap();
        let back = from_safetensors_bytes(arch, &bytes).unwrap().0;
        assert_eq!(sorted_keys(&back), sorted_keys_of(&want), "{arch}");
    }
}

#[test]
fn strict_load_lists_every_missing_unexpected_and_misshaped_name() {
    let good = ordered("resnet20.safetensors");
    let mut net = resnet("resnet20", 10, &mut Generator::new(4)).unwrap();
    let before = net.state_dict();
    let mut bad: NamedTensors = good
        .iter()
        .filter(|(n, _)| n != "layer2.1.conv2.weight" && n != "bn1.num_batches_tracked")
        .cloned()
        .collect();
    for (name, t) in bad.iter_mut() {
        match name.as_str() {
            // A renamed buffer: missing under its name, unexpected under the other.
            "layer1.0.bn1.running_mean" => *name = "layer1.0.bn1.running_avg".into(),
            // 11 classes instead of 10.
            "fc.weight" => *t = Tensor::zeros(&[11, 64], DType::F32).unwrap(),
            "fc.bias" => *t = Tensor::zeros(&[11], DType::F32).unwrap(),
            _ => {}
        }
    }
    // An option-B projection the option-A network does not have, and a duplicate.
    bad.push((
        "layer2.0.downsample.0.weight".into(),
        Tensor::zeros(&[32, 16, 1, 1], DType::F32).unwrap(),
    ));
    bad.push(good[0].clone());

    let m = state_dict_mismatch(&net, &bad);
    assert_eq!(
        m.missing,
        [
            "bn1.num_batches_tracked",
            "layer1.0.bn1.running_mean",
            "layer2.1.conv2.weight"
        ]
    );
    assert_eq!(
        m.unexpected,
        ["layer1.0.bn1.running_avg", "layer2.0.downsample.0.weight"]
    );
    assert_eq!(m.duplicated, ["conv1.weight"]);
    assert_eq!(
        m.shapes,
        [
            ("fc.weight".to_string(), vec![11, 64], vec![10, 64]),
            ("fc.bias".to_string(), vec![11], vec![10]),
        ]
    );
    let e = load_state_dict_strict(&mut net, &bad)
        .unwrap_err()
        .to_string();
    for needle in [
        "3 missing key(s): bn1.num_batches_tracked, layer1.0.bn1.running_mean, \
         layer2.1.conv2.weight",
        "2 unexpected key(s): layer1.0.bn1.running_avg, layer2.0.downsample.0.weight",
        "1 duplicated key(s): conv1.weight",
        "fc.weight: checkpoint [11, 64], model [10, 64]",
        "fc.bias: checkpoint [11], model [10]",
    ] {
        assert!(e.contains(needle), "{needle:?} not in {e}");
    }
    // Nothing was loaded.
    assert_loaded(&net, &before);

    // A torchvision resnet18 dict offered to resnet34: the extra blocks are missing.
    let (_, r18) = manifest("resnet18");
    let r34 = resnet("resnet34", 1000, &mut Generator::new(5)).unwrap();
    let m = state_dict_mismatch(&r34, &r18);
    assert!(m.unexpected.is_empty() && m.shapes.is_empty() && m.duplicated.is_empty());
    assert_eq!(m.missing.len(), 218 - 122);
    assert!(m
        .missing
        .iter()
        .any(|n| n == "layer3.5.bn2.num_batches_tracked"));
    // The unmodified dict has no mismatch.
    assert!(state_dict_mismatch(&net, &good).is_empty());
}
