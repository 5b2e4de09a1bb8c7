//! `hemi doctor`: how far a precision preset strays from FP32, module by module, on a
//! model and its data (`hemi::train::doctor`), and with `--search` a precision policy that
//! keeps the preset's loss within a tolerance of FP32's.

use std::path::PathBuf;

use clap::Args;
use hemi::amp::PrecisionPolicy;
use hemi::data::{Batch, DataLoader};
use hemi::nn::Module;
use hemi::train::doctor::{diagnose, train_losses, Diagnosis};
use hemi::train::TrainConfig;
use hemi::{DType, Error, Result};

/// What `hemi doctor` adds to `hemi train`'s flags.
#[derive(Args, Debug, Clone)]
pub struct DoctorOpts {
    /// Training steps to diagnose (one batch each, in the training order of `hemi train`).
    #[arg(help_heading = "Doctor", long, default_value_t = 20)]
    pub steps: usize,
    /// The reference the preset is compared with: f32, or f64 (to check the doctor itself
    /// on small models).
    #[arg(help_heading = "Doctor", long, default_value = "f32", value_parser = ["f32", "f64"])]
    pub reference: String,
    /// Write the report as JSON to this file.
    #[arg(help_heading = "Doctor", long)]
    pub json: Option<PathBuf>,
    /// Draw the per-module errors into this PNG file.
    #[arg(help_heading = "Doctor", long)]
    pub plot: Option<PathBuf>,
    /// Search a small set of modules to keep in F32 (greedy over the report's ranking) so
    /// that the preset's loss stays within --tolerance of FP32's, and write it as a policy
    /// file for `hemi train --policy`.
    #[arg(help_heading = "Doctor", long)]
    pub search: bool,
    /// With --search: the largest accepted |loss − FP32 loss| (mean over the last quarter of
    /// the steps).
    #[arg(help_heading = "Doctor", long, default_value_t = 0.02)]
    pub tolerance: f64,
    /// With --search: at most this many modules pinned.
    #[arg(help_heading = "Doctor", long, default_value_t = 8)]
    pub max_pins: usize,
    /// With --search: candidate modules tried per round (the best-ranked not yet pinned).
    #[arg(help_heading = "Doctor", long, default_value_t = 4)]
    pub candidates: usize,
    /// With --search: where the policy file goes.
    #[arg(help_heading = "Doctor", long, default_value = "policy.json")]
    pub write_policy: PathBuf,
}

/// The first `n` training batches (through as many epochs as it takes).
fn batches(loader: &DataLoader, n: usize) -> Result<Vec<Batch>> {
    if loader.num_batches() == 0 {
        return Err(Error::arg("doctor", "the training set is empty"));
    }
    let mut v = Vec::with_capacity(n);
    let mut epoch = 0u64;
    while v.len() < n {
        for b in loader.epoch(epoch).take(n - v.len()) {
            v.push(b?);
        }
        epoch += 1;
    }
    Ok(v)
}

/// Runs the doctor on the model `make` builds and the first batches of `loader`.
pub fn run(
    opts: &DoctorOpts,
    make: &dyn Fn() -> Result<Box<dyn Module>>,
    loader: &DataLoader,
    cfg: &TrainConfig,
) -> Result<()> {
    if opts.steps == 0 {
        return Err(Error::arg("doctor", "--steps must be at least 1"));
    }
    if opts.search && !(opts.tolerance >= 0.0 && opts.tolerance.is_finite()) {
        return Err(Error::arg(
            "doctor",
            "--tolerance must be a finite number >= 0",
        ));
    }
    let reference = if opts.reference == "f64" {
        DType::F64
    } else {
        DType::F32
    };
    let data = batches(loader, opts.steps)?;
    let t0 = std::time::Instant::now();
    let d = diagnose(make, &data, cfg, reference)?;
    print!("{}", d.table());
    println!("({:.1} s)", t0.elapsed().as_secs_f64());
    let ranking: Vec<String> = d.ranking().iter().map(|m| m.module.clone()).collect();
    println!(
        "ranking (the modules that lose the most precision themselves first): {}",
        ranking
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut json = d.to_json();
    if let Some(p) = &opts.plot {
        crate::plot::doctor_chart(&d, p)?;
        println!("plot: {}", p.display());
    }
    if opts.search {
        let found = search(opts, make, &data, cfg, &d)?;
        json["search"] = found;
    }
    if let Some(p) = &opts.json {
        hemi::io::atomic_write(
            p,
            serde_json::to_string_pretty(&json)
                .expect("JSON")
                .as_bytes(),
        )?;
        println!("report: {}", p.display());
    }
    Ok(())
}

/// Greedy search over the ranking: pins one more module at a time, the one of the
/// best-ranked candidates that brings the preset's loss closest to FP32's, until it is
/// within the tolerance.
fn search(
    opts: &DoctorOpts,
    make: &dyn Fn() -> Result<Box<dyn Module>>,
    data: &[Batch],
    cfg: &TrainConfig,
    d: &Diagnosis,
) -> Result<serde_json::Value> {
    let probe = make()?;
    let paths = hemi::amp::policy::module_paths(&*probe);
    let leaves: Vec<String> = probe
        .named_parameters()
        .iter()
        .map(|(n, _)| hemi::ops::check::module_of(n).to_string())
        .collect();
    drop(probe);
    // A candidate is a layer or a small block (an attention's softmax scope holds its
    // query, key and value): a site such as `bert` or `layer3` would pin a whole stage.
    let small = |p: &str| {
        let mut inside: Vec<&String> = leaves
            .iter()
            .filter(|l| hemi::ops::scope::within(l, p))
            .collect();
        inside.dedup();
        inside.len() <= 4
    };
    let tail = hemi::train::doctor::tail_mean;
    let target = tail(&d.loss_reference);
    let mut base = cfg.policy.clone().unwrap_or_default();
    let mut tried = Vec::new();
    let gap = |losses: &[f64]| (tail(losses) - target).abs();
    let mut current = gap(&d.loss_preset);
    println!(
        "search: the preset's loss is {:.5} against FP32's {target:.5} (|difference| {current:.5}, \
         tolerance {})",
        tail(&d.loss_preset),
        opts.tolerance
    );
    let mut pinned: Vec<String> = Vec::new();
    // Candidates: the ranking's modules (a fused op's site names two; a scope is a module
    // path too), each a set of module paths a policy can name.
    let candidates: Vec<Vec<String>> = d
        .ranking()
        .iter()
        .map(|m| {
            m.module
                .split('+')
                .filter(|p| paths.iter().any(|q| q == p) && small(p))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|v| !v.is_empty())
        .collect();
    // Forward selection: each round tries the best-ranked --candidates sets not yet pinned
    // and keeps the one that brings the loss closest to FP32's.
    while !(current.is_finite() && current <= opts.tolerance) && pinned.len() < opts.max_pins {
        // A set that would pin every parameter is plain FP32, not a policy (and under
        // pure-fp16 leaves the optimizer no half weight): never a candidate.
        let all_pinned = |c: &Vec<String>| {
            leaves.iter().all(|l| {
                pinned
                    .iter()
                    .chain(c)
                    .any(|p| hemi::ops::scope::within(l, p))
            })
        };
        let round: Vec<&Vec<String>> = candidates
            .iter()
            .filter(|c| c.iter().any(|m| !pinned.contains(m)))
            .filter(|c| !all_pinned(c))
            .take(opts.candidates.max(1))
            .collect();
        if round.is_empty() {
            println!(
                "search: every candidate left would pin all the parameters (plain FP32); stopping"
            );
            break;
        }
        let mut best: Option<(f64, PrecisionPolicy, Vec<String>, f64)> = None;
        for c in round {
            let mut trial = base.clone();
            let mods: Vec<String> = c.iter().filter(|m| !pinned.contains(m)).cloned().collect();
            for m in &mods {
                trial.modules.push((m.clone(), DType::F32));
            }
            let mut cc = cfg.clone();
            cc.policy = Some(trial.clone());
            let (losses, skipped) = train_losses(make, data, &cc, cfg.precision, Some(&trial))?;
            let g = gap(&losses);
            println!(
                "search: {} + {} -> loss {:.5} (|difference| {g:.5}, {skipped} skipped)",
                if pinned.is_empty() {
                    "(none)".to_string()
                } else {
                    pinned.join(", ")
                },
                mods.join(", "),
                tail(&losses)
            );
            tried.push(serde_json::json!({"pinned": pinned, "added": mods, "loss": tail(&losses), "gap": g}));
            if best.as_ref().is_none_or(|b| g < b.0) {
                best = Some((g, trial, mods, tail(&losses)));
            }
        }
        let Some((g, trial, mods, _)) = best else {
            break;
        };
        if g.partial_cmp(&current) != Some(std::cmp::Ordering::Less) {
            println!("search: no candidate brings the loss closer; stopping");
            break;
        }
        base = trial;
        pinned.extend(mods);
        current = g;
    }
    let ok = current.is_finite() && current <= opts.tolerance;
    if ok {
        base.save(&opts.write_policy)?;
        println!(
            "search: {} module{} in F32 keep the loss within {} of FP32's; policy written to {} \
             (train with --policy {})",
            pinned.len(),
            if pinned.len() == 1 { "" } else { "s" },
            opts.tolerance,
            opts.write_policy.display(),
            opts.write_policy.display()
        );
    } else {
        println!(
            "search: no policy of at most {} modules reached the tolerance (best |difference| \
             {current:.5}); nothing written",
            opts.max_pins
        );
    }
    Ok(
        serde_json::json!({"tolerance": opts.tolerance, "steps": tried, "reached": ok,
        "policy": ok.then(|| serde_json::from_str::<serde_json::Value>(&base.to_json()).ok())}),
    )
}
