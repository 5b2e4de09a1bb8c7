//! Times one training step's forward and backward of a ResNet on a random batch, in F32
//! and under BF16 and F16 autocast (F32 weights). Not a benchmark harness: a quick figure.
//!
//! cargo run --release -p hemi --example resnet_timing -- [ARCH] [BATCH] [ITERS]

use std::time::Instant;

use hemi::amp::autocast;
use hemi::models::resnet;
use hemi::nn::Module;
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::{DType, Generator, Result, Tensor};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arch = args.get(1).map_or("resnet20", String::as_str);
    let batch: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(128);
    let iters: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3).max(1);
    let mut rng = Generator::new(0);
    let net = resnet(arch, 10, &mut rng)?;
    let side = if arch == "resnet18" || arch == "resnet34" || arch == "resnet50" {
        224
    } else {
        32
    };
    let x = Tensor::randn(&[batch, 3, side, side], 0.0, 1.0, DType::F32, &mut rng)?;
    let y = Tensor::randint(&[batch], 10, &mut rng)?;
    println!(
        "{arch}: {} parameters, batch {batch} of 3x{side}x{side}",
        net.num_parameters()
    );
    for (label, dtype) in [
        ("fp32", None),
        ("amp-bf16", Some(DType::BF16)),
        ("amp-f16", Some(DType::F16)),
    ] {
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for i in 0..=iters {
            net.zero_grad();
            let t0 = Instant::now();
            let loss = {
                let _ac = dtype.map(autocast);
                cross_entropy(&net.forward(&x)?, &y, CrossEntropyOptions::default())?
            };
            let t1 = Instant::now();
            loss.backward()?;
            let t2 = Instant::now();
            if i > 0 {
                // the first iteration warms up allocations and caches
                fwd.push((t1 - t0).as_secs_f64());
                bwd.push((t2 - t1).as_secs_f64());
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (f, b) = (med(&mut fwd), med(&mut bwd));
        println!(
            "{label:>9}: forward {f:.3} s, backward {b:.3} s (median of {iters}), {:.0} img/s",
            batch as f64 / (f + b)
        );
    }
    Ok(())
}
