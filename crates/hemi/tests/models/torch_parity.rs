//! hemi's Sgd, Adam, AdamW and GradScaler against PyTorch, bit for bit.
//!
//! `bench/torch_parity_fixtures.py` ran PyTorch's single-tensor CPU optimizers (and
//! `torch.amp.GradScaler` around SGD) on exact inputs and recorded, after every step, a hash
//! of the parameters' F32 bits, full snapshots at a few steps, and for the scaler the scale's
//! F32 bits and whether the step was skipped (`tests/fixtures/torch_parity/`, the script's
//! docstring gives the layout). Each test here rebuilds the same inputs from the same integer
//! hash, drives hemi through its public API the way training does (`set_grad`, `step`,
//! `GradScaler::step` / `update`), and requires the same bits at every step. A failure names
//! the first differing step, the first differing index at the next snapshot and the distance
//! in ulps there and at the end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hemi::amp::scaler::{GradScaler, GradScalerConfig};
use hemi::optim::{Adam, AdamConfig, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use hemi::{DType, Tensor};
use serde_json::Value;

// ----- the inputs, exactly as the script makes them -------------------------------------------

/// SplitMix64's finaliser (the script's `mix`).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The script's `value`: `n` exact F32 values, each a signed 24-bit integer times a power of
/// two below `2^amp`.
fn value(seed: u64, step: u64, param: u64, n: usize, amp: i32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = mix(seed ^ mix((step << 32) ^ ((param << 20) + i)));
            let u = (h >> 40) as i64 - (1 << 23);
            let e = (h & 7) as i32 + amp - 30;
            // Both factors are exact F32 values and the product stays normal: exact.
            u as f32 * 2f32.powi(e)
        })
        .collect()
}

/// The script's `params_hash`: `sum_k bits_k * (2k+1) * golden (mod 2^64)`.
fn params_hash(values: &[Vec<f32>]) -> u64 {
    values
        .iter()
        .flatten()
        .enumerate()
        .fold(0u64, |acc, (k, x)| {
            let m = (2 * k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            acc.wrapping_add(u64::from(x.to_bits()).wrapping_mul(m))
        })
}

// ----- fixtures -------------------------------------------------------------------------------

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_parity")
}

/// One recorded PyTorch run.
struct Case {
    name: String,
    kind: String,
    seed: u64,
    sizes: Vec<usize>,
    steps: usize,
    amp: i32,
    /// Hyper-parameters, from the bits of PyTorch's Python floats.
    hyper: BTreeMap<String, f64>,
    flags: Value,
    /// Step -> "inf" | "-inf" | "nan" poisoned into parameter 0 before scaling.
    infs: BTreeMap<usize, f32>,
    snapshot_steps: Vec<usize>,
    hashes: Vec<u64>,
    /// `[snapshot][parameter][element]`.
    snapshots: Vec<Vec<Vec<f32>>>,
    /// Scaler runs: the scale's F32 bits and the skip flag after each step.
    scales: Vec<u32>,
    skipped: Vec<bool>,
}

impl Case {
    fn load(json: &Path) -> Case {
        let m: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", json.display()));
        let data = std::fs::read(json.with_extension("bin")).unwrap();
        let usize_of = |v: &Value| v.as_u64().unwrap() as usize;
        let sizes: Vec<usize> = m["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .map(usize_of)
            .collect();
        let steps = usize_of(&m["steps"]);
        let snapshot_steps: Vec<usize> = (m["snapshot_steps"].as_array().unwrap().iter())
            .map(usize_of)
            .collect();
        let hyper = (m["hyper_bits"].as_object().unwrap().iter())
            .map(|(k, v)| {
                let bits = u64::from_str_radix(v.as_str().unwrap(), 16).unwrap();
                (k.clone(), f64::from_bits(bits))
            })
            .collect();
        let infs = (m["infs"].as_object().unwrap().iter())
            .map(|(k, v)| {
                let x = match v.as_str().unwrap() {
                    "inf" => f32::INFINITY,
                    "-inf" => f32::NEG_INFINITY,
                    "nan" => f32::NAN,
                    other => panic!("unknown event {other:?}"),
                };
                (k.parse().unwrap(), x)
            })
            .collect();

        let mut at = 0;
        let mut take = |n: usize| {
            let s = &data[at..at + n];
            at += n;
            s
        };
        let hashes = (take(8 * steps).chunks_exact(8))
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let total: usize = sizes.iter().sum();
        let snapshots = (0..snapshot_steps.len())
            .map(|_| {
                let flat: Vec<f32> = (take(4 * total).chunks_exact(4))
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let mut off = 0;
                (sizes.iter())
                    .map(|&n| {
                        off += n;
                        flat[off - n..off].to_vec()
                    })
                    .collect()
            })
            .collect();
        let kind = m["kind"].as_str().unwrap().to_string();
        let (mut scales, mut skipped) = (Vec::new(), Vec::new());
        if kind == "scaler" {
            scales = (take(4 * steps).chunks_exact(4))
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            skipped = take(steps).iter().map(|&b| b == 1).collect();
        }
        assert_eq!(at, data.len(), "{}: trailing bytes", json.display());
        Case {
            name: m["name"].as_str().unwrap().to_string(),
            kind,
            seed: m["seed"].as_u64().unwrap(),
            sizes,
            steps,
            amp: m["amp"].as_i64().unwrap() as i32,
            hyper,
            flags: m["flags"].clone(),
            infs,
            snapshot_steps,
            hashes,
            snapshots,
            scales,
            skipped,
        }
    }

    fn h(&self, name: &str) -> f64 {
        *self
            .hyper
            .get(name)
            .unwrap_or_else(|| panic!("{}: no hyper-parameter {name}", self.name))
    }

    fn flag(&self, name: &str) -> bool {
        self.flags[name].as_bool().unwrap()
    }
}

/// Every fixture of `kind`; errors when there is none (a missing fixture must not pass).
fn cases(kind: &str) -> Vec<Case> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixture_dir())
        .expect("tests/fixtures/torch_parity (run bench/torch_parity_fixtures.py)")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    let all: Vec<Case> = paths.iter().map(|p| Case::load(p)).collect();
    let found: Vec<Case> = all.into_iter().filter(|c| c.kind == kind).collect();
    assert!(!found.is_empty(), "no {kind} fixtures");
    found
}

// ----- comparing ------------------------------------------------------------------------------

/// Distance in ulps between two F32 values (adjacent floats are 1 apart, across zero too).
fn ulps(a: f32, b: f32) -> u64 {
    let key = |x: f32| {
        let i = x.to_bits() as i32;
        if i < 0 {
            -i64::from(i & 0x7FFF_FFFF)
        } else {
            i64::from(i)
        }
    };
    key(a).abs_diff(key(b))
}

/// First differing (parameter, index) and the largest distance in ulps.
fn diff(got: &[Vec<f32>], want: &[Vec<f32>]) -> (Option<(usize, usize)>, u64) {
    let mut first = None;
    let mut worst = 0;
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
            if a.to_bits() != b.to_bits() {
                first.get_or_insert((j, i));
                worst = worst.max(ulps(a, b));
            }
        }
    }
    (first, worst)
}

/// What hemi produced: parameters after each snapshot step, a hash per step and (scaler
/// runs) the scale bits and skip flags.
#[derive(Default)]
struct Run {
    hashes: Vec<u64>,
    snapshots: Vec<Vec<Vec<f32>>>,
    scales: Vec<u32>,
    skipped: Vec<bool>,
    /// The first step after which the scale was not an F32 value (PyTorch's is an F32 tensor).
    scale_not_f32: Option<usize>,
}

/// Compares a run with the recording; `Err` describes the first difference.
fn compare(case: &Case, run: &Run) -> Result<(), String> {
    let mut msgs = Vec::new();
    if let Some(s) = (0..case.steps).find(|&s| run.hashes[s] != case.hashes[s]) {
        let step = s + 1;
        let mut msg = format!("parameters first differ after step {step}");
        if let Some(k) = case.snapshot_steps.iter().position(|&t| t >= step) {
            let (first, worst) = diff(&run.snapshots[k], &case.snapshots[k]);
            if let Some((j, i)) = first {
                let (g, w) = (run.snapshots[k][j][i], case.snapshots[k][j][i]);
                msg += &format!(
                    "; at step {} first at parameter {j} index {i} (hemi {g:e} = {:#010x}, \
                     torch {w:e} = {:#010x}), up to {worst} ulp",
                    case.snapshot_steps[k],
                    g.to_bits(),
                    w.to_bits()
                );
            }
        }
        let last = case.snapshots.len() - 1;
        let (_, worst) = diff(&run.snapshots[last], &case.snapshots[last]);
        msg += &format!("; after the last step ({}) up to {worst} ulp", case.steps);
        msgs.push(msg);
    }
    if case.kind == "scaler" {
        if let Some(t) = run.scale_not_f32 {
            msgs.push(format!("the scale is not an F32 value after step {t}"));
        }
        if let Some(s) = (0..case.steps).find(|&s| run.skipped[s] != case.skipped[s]) {
            msgs.push(format!(
                "skip flags first differ at step {} (hemi {}, torch {}); hemi skipped {} \
                 steps, torch {}",
                s + 1,
                run.skipped[s],
                case.skipped[s],
                run.skipped.iter().filter(|&&b| b).count(),
                case.skipped.iter().filter(|&&b| b).count()
            ));
        }
        if let Some(s) = (0..case.steps).find(|&s| run.scales[s] != case.scales[s]) {
            msgs.push(format!(
                "scales first differ after step {} (hemi {:e}, torch {:e})",
                s + 1,
                f32::from_bits(run.scales[s]),
                f32::from_bits(case.scales[s])
            ));
        }
    }
    if msgs.is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {}", case.name, msgs.join("; ")))
    }
}

/// Runs every case through `drive` and fails listing every case that differs.
fn check_all(kind: &str, drive: impl Fn(&Case) -> Run) {
    let failures: Vec<String> = cases(kind)
        .iter()
        .filter_map(|c| compare(c, &drive(c)).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} {kind} case(s) differ from PyTorch:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ----- driving hemi ---------------------------------------------------------------------------

fn make_params(case: &Case) -> Vec<Tensor> {
    (case.sizes.iter().enumerate())
        .map(|(j, &n)| {
            Tensor::from_f32_vec(value(case.seed, 0, j as u64, n, 0), &[n], DType::F32)
                .unwrap()
                .requires_grad_()
        })
        .collect()
}

/// Step `t`'s gradients, parameter 0 poisoned where the case says so.
fn grads(case: &Case, t: usize) -> Vec<Vec<f32>> {
    (case.sizes.iter().enumerate())
        .map(|(j, &n)| {
            let mut g = value(case.seed, t as u64, j as u64, n, case.amp);
            if let (0, Some(&bad)) = (j, case.infs.get(&t)) {
                g[(t * 7) % n] = bad;
            }
            g
        })
        .collect()
}

/// Records hashes and snapshots of `params` after step `t`.
fn record(case: &Case, run: &mut Run, params: &[Tensor], t: usize) {
    let v: Vec<Vec<f32>> = params.iter().map(Tensor::to_vec_f32).collect();
    run.hashes.push(params_hash(&v));
    if case.snapshot_steps.contains(&t) {
        run.snapshots.push(v);
    }
}

fn sgd_config(case: &Case) -> SgdConfig {
    SgdConfig {
        lr: case.h("lr"),
        momentum: case.h("momentum"),
        dampening: case.hyper.get("dampening").copied().unwrap_or(0.0),
        weight_decay: case.hyper.get("weight_decay").copied().unwrap_or(0.0),
        nesterov: case
            .flags
            .get("nesterov")
            .is_some_and(|v| v.as_bool() == Some(true)),
    }
}

fn adam_config(case: &Case) -> AdamConfig {
    AdamConfig {
        lr: case.h("lr"),
        betas: (case.h("beta1"), case.h("beta2")),
        eps: case.h("eps"),
        weight_decay: case.h("weight_decay"),
        amsgrad: case.flag("amsgrad"),
    }
}

/// A plain optimizer run: gradients set, `step`, record.
fn drive_optimizer(case: &Case, build: impl FnOnce(Vec<Tensor>) -> Box<dyn Optimizer>) -> Run {
    let params = make_params(case);
    let mut opt = build(params.clone());
    let mut run = Run::default();
    for t in 1..=case.steps {
        for (p, g) in params.iter().zip(grads(case, t)) {
            let n = g.len();
            p.set_grad(Some(Tensor::from_f32_vec(g, &[n], DType::F32).unwrap()));
        }
        opt.step().unwrap();
        record(case, &mut run, &params, t);
    }
    run
}

#[test]
fn sgd_matches_torch_bit_for_bit() {
    check_all("sgd", |c| {
        drive_optimizer(c, |p| Box::new(Sgd::new(p, sgd_config(c)).unwrap()))
    });
}

#[test]
fn adam_matches_torch_bit_for_bit() {
    check_all("adam", |c| {
        drive_optimizer(c, |p| Box::new(Adam::new(p, adam_config(c)).unwrap()))
    });
}

#[test]
fn adamw_matches_torch_bit_for_bit() {
    check_all("adamw", |c| {
        drive_optimizer(c, |p| {
            Box::new(AdamW::new(p, AdamWConfig::from(adam_config(c))).unwrap())
        })
    });
}

/// SGD through the scaler as a training step does it, with the backward pass replaced by its
/// result: each gradient is `g * scale` in F32 (what `scale(loss).backward()` gives for a loss
/// whose gradient is g), then `step` and `update`.
#[test]
fn grad_scaler_matches_torch_bit_for_bit() {
    check_all("scaler", |c| {
        let params = make_params(c);
        let mut opt = Sgd::new(
            params.clone(),
            SgdConfig {
                lr: c.h("lr"),
                momentum: c.h("momentum"),
                ..SgdConfig::default()
            },
        )
        .unwrap();
        // PyTorch's defaults but for the values the case sets: no cap, no floor, no
        // hysteresis.
        let mut scaler = GradScaler::new(GradScalerConfig {
            init_scale: c.h("init_scale"),
            growth_factor: c.h("growth_factor"),
            backoff_factor: c.h("backoff_factor"),
            growth_interval: c.flags["growth_interval"].as_u64().unwrap(),
            ..GradScalerConfig::default()
        })
        .unwrap();
        let mut run = Run::default();
        for t in 1..=c.steps {
            let scale = scaler.get_scale() as f32;
            for (p, g) in params.iter().zip(grads(c, t)) {
                let n = g.len();
                let scaled = g.iter().map(|&x| x * scale).collect();
                p.set_grad(Some(
                    Tensor::from_f32_vec(scaled, &[n], DType::F32).unwrap(),
                ));
            }
            let stepped = scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            run.skipped.push(!stepped);
            let s = scaler.get_scale();
            if f64::from(s as f32) != s {
                run.scale_not_f32.get_or_insert(t);
            }
            run.scales.push((s as f32).to_bits());
            record(c, &mut run, &params, t);
        }
        // The scale survives a checkpoint exactly.
        let mut restored = GradScaler::new(GradScalerConfig::default()).unwrap();
        restored.load_state_dict(&scaler.state_dict()).unwrap();
        assert_eq!(
            restored.get_scale().to_bits(),
            scaler.get_scale().to_bits(),
            "{}: scale after load_state_dict",
            c.name
        );
        run
    });
}

#[test]
fn the_inputs_are_the_scripts() {
    // Values printed by the script's own `value` and `params_hash`, so that a failure above
    // is about the arithmetic, not the inputs.
    let v = value(7, 3, 1, 4, 0);
    let bits: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
    assert_eq!(bits, [0x3b1dc7bc, 0xbc95dc60, 0x3e4bfb3c, 0xbea6f4cc]);
    assert_eq!(params_hash(&[v, value(1, 2, 0, 3, -2)]), 0xb749c9ae4afe8984);
}
