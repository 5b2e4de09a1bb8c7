//! The training loop of the user's documents, written by hand against the library: CifarNet,
//! SGD (lr 0.001, momentum 0.9), batch 128, inputs normalised with mean 0.5 / std 0.5, the
//! loss printed as `[epoch, batch] loss: x.xxx`, then the test accuracy. Three forms of the
//! same loop, each from the same initial weights:
//!
//! 1. PyTorch's: `autocast` around the forward pass, a `GradScaler` around backward and step.
//!    The weights stay F32, so they are the master weights; autocast casts them to F16 per
//!    op.
//! 2. apex's `FP16_Optimizer`: the model itself in F16 (BatchNorm would stay F32), trained
//!    through F32 master copies by `Fp16Optimizer`, which scales the loss itself.
//! 3. Keras' `mixed_float16` policy: `Precision::parse("mixed_float16")` is hemi's `amp-fp16`
//!    preset, and `AmpOptimizer` runs its step.
//!
//! On the built-in synthetic data (no download) and short by default, so it runs in seconds:
//!
//! ```text
//! cargo run --release -p hemi --example documents_loop
//! cargo run --release -p hemi --example documents_loop -- \
//!     --train 10000 --test 1000 --epochs 10 --log-every 20
//! ```
//!
//! The second line is the documents' full 10 epochs (on the default synthetic set, as `hemi
//! train` runs them); with the documents' small lr the first epochs are a plateau near 10 %
//! accuracy, so the short run shows the loss starting to fall rather than a trained network.

use std::sync::Arc;
use std::time::Instant;

use hemi::amp::{autocast, AmpOptimizer, Fp16Optimizer, GradScaler, GradScalerConfig};
use hemi::amp::{MasterConfig, Precision};
use hemi::data::{DataLoader, LoaderConfig, Split, Synthetic, Transform};
use hemi::models::CifarNet;
use hemi::nn::Module;
use hemi::ops::loss::{cross_entropy, CrossEntropyOptions};
use hemi::optim::{Optimizer, Sgd, SgdConfig};
use hemi::{DType, Error, Generator, Result, Tensor};

/// The documents' optimizer settings.
fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.001,
        momentum: 0.9,
        ..Default::default()
    }
}

struct Args {
    train: usize,
    test: usize,
    epochs: u64,
    log_every: usize,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        train: 1280,
        test: 500,
        epochs: 1,
        log_every: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| Error::Msg(format!("{flag} needs a value")))?;
        let n: usize = value
            .parse()
            .map_err(|_| Error::Msg(format!("{flag} {value}: not a number")))?;
        match flag.as_str() {
            "--train" => a.train = n,
            "--test" => a.test = n,
            "--epochs" => a.epochs = n as u64,
            "--log-every" => a.log_every = n.max(1),
            _ => {
                return Err(Error::Msg(format!(
                    "unknown flag {flag} (--train N, --test N, --epochs N, --log-every N)"
                )))
            }
        }
    }
    Ok(a)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    // torchvision's `transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))` after ToTensor.
    let loader = |split, len, shuffle| -> Result<DataLoader> {
        let data = Synthetic::try_generate(0, split, len)?;
        DataLoader::new(
            Arc::new(data),
            LoaderConfig {
                batch_size: 128,
                shuffle,
                transform: Transform::new().normalize(&[0.5], &[0.5]),
                ..Default::default()
            },
        )
    };
    let train = loader(Split::Train, args.train, true)?;
    let test = loader(Split::Test, args.test, false)?;
    println!(
        "synthetic data: {} training and {} test images of 32x32 in 10 classes, batch 128, \
         {} epoch(s)",
        args.train, args.test, args.epochs
    );

    // 1. PyTorch: autocast + GradScaler around an ordinary SGD on F32 weights.
    println!("\n== 1. autocast(F16) + GradScaler, F32 weights (torch.autocast + GradScaler)");
    let start = Instant::now();
    let net = CifarNet::cifar10(&mut Generator::new(0))?;
    let mut opt = Sgd::new(net.parameters(), sgd())?;
    let mut scaler = GradScaler::new(GradScalerConfig::default())?;
    for epoch in 0..args.epochs {
        let mut running_loss = 0.0;
        for (i, batch) in train.epoch(epoch).enumerate() {
            let batch = batch?;
            opt.zero_grad();
            let loss = {
                let _ac = autocast(DType::F16); // conv and linear in F16, cross-entropy in F32
                let outputs = net.forward(batch.images()?)?;
                cross_entropy(&outputs, &batch.labels, CrossEntropyOptions::default())?
            };
            scaler.scale(&loss)?.backward()?;
            scaler.step(&mut opt)?; // unscales the gradients; skipped if one is inf/NaN
            scaler.update()?;
            running_loss += loss.to_scalar()?;
            if (i + 1) % args.log_every == 0 {
                let mean = running_loss / args.log_every as f64;
                println!("[{}, {:5}] loss: {mean:.3}", epoch + 1, i + 1);
                running_loss = 0.0;
            }
        }
    }
    report(&net, &test, DType::F32)?;
    println!(
        "loss scale {} after {} steps, {} skipped; weights {}; {:.1} s",
        scaler.get_scale(),
        train.num_batches() as u64 * args.epochs,
        scaler.skipped_steps(),
        net.parameters()[0].dtype(),
        start.elapsed().as_secs_f64()
    );

    // 2. apex FP16_Optimizer: an F16 model, F32 master weights, the loss scaled inside.
    println!("\n== 2. F16 model + F32 master weights (apex FP16_Optimizer, preset fp16-master)");
    let start = Instant::now();
    let mut net = CifarNet::cifar10(&mut Generator::new(0))?;
    net.to_dtype(DType::F16, true)?; // `model.half()`; norm layers (none here) stay F32
    let mut opt = Fp16Optimizer::new(net.parameters(), MasterConfig::default(), |masters| {
        Ok(Box::new(Sgd::new(masters, sgd())?) as Box<dyn Optimizer>)
    })?;
    for epoch in 0..args.epochs {
        let mut running_loss = 0.0;
        for (i, batch) in train.epoch(epoch).enumerate() {
            let batch = batch?;
            opt.zero_grad();
            let images = batch.images()?.to_dtype(DType::F16)?;
            let loss = cross_entropy(&net.forward(&images)?, &batch.labels, Default::default())?;
            opt.scale_loss(&loss)?.backward()?;
            opt.step()?; // unscale into the masters, skip on overflow, SGD, write back to F16
            running_loss += loss.to_scalar()?;
            if (i + 1) % args.log_every == 0 {
                let mean = running_loss / args.log_every as f64;
                println!("[{}, {:5}] loss: {mean:.3}", epoch + 1, i + 1);
                running_loss = 0.0;
            }
        }
    }
    report(&net, &test, DType::F16)?;
    println!(
        "loss scale {}, {} skipped; weights {}, masters {}; {:.1} s",
        opt.loss_scale(),
        opt.skipped_steps(),
        net.parameters()[0].dtype(),
        opt.masters()[0].dtype(),
        start.elapsed().as_secs_f64()
    );

    // 3. Keras: the mixed_float16 policy.
    println!("\n== 3. Keras policy mixed_float16 (Precision::parse + AmpOptimizer)");
    let start = Instant::now();
    let policy = Precision::parse("mixed_float16")?;
    println!(
        "policy {policy}: variables {}, compute {}, loss scaling {}",
        policy.weight_dtype(),
        policy.compute_dtype(),
        policy.loss_scaling()
    );
    let mut net = CifarNet::cifar10(&mut Generator::new(0))?;
    policy.prepare_model(&mut net)?; // nothing to cast: mixed_float16 keeps F32 variables
    let mut opt = AmpOptimizer::new(
        policy,
        net.parameters(),
        GradScalerConfig::default(),
        0,
        |params| Ok(Box::new(Sgd::new(params, sgd())?) as Box<dyn Optimizer>),
    )?;
    for epoch in 0..args.epochs {
        let mut running_loss = 0.0;
        for (i, batch) in train.epoch(epoch).enumerate() {
            let batch = batch?;
            opt.zero_grad();
            let loss = {
                let _ac = policy.autocast();
                let outputs = net.forward(&policy.input(batch.images()?)?)?;
                cross_entropy(&outputs, &batch.labels, Default::default())?
            };
            opt.backward(&loss)?;
            opt.step()?;
            running_loss += loss.to_scalar()?;
            if (i + 1) % args.log_every == 0 {
                let mean = running_loss / args.log_every as f64;
                println!("[{}, {:5}] loss: {mean:.3}", epoch + 1, i + 1);
                running_loss = 0.0;
            }
        }
    }
    report(&net, &test, policy.weight_dtype())?;
    println!(
        "loss scale {}, {} skipped; {:.1} s",
        opt.scale(),
        opt.skipped_steps(),
        start.elapsed().as_secs_f64()
    );
    println!(
        "\nWith the documents' lr 0.001 the first epochs are a plateau near 10 %; `hemi train` \
         runs the full recipe (10 epochs of 10,000 images) to about 81 % on this data."
    );
    Ok(())
}

/// The documents' evaluation: no gradients, the class with the largest logit, the share of
/// test images it gets right. `input` is the dtype of the model's first layer.
fn report(net: &dyn Module, test: &DataLoader, input: DType) -> Result<()> {
    let _g = hemi::no_grad();
    let (mut correct, mut total) = (0usize, 0usize);
    for batch in test.epoch(0) {
        let batch = batch?;
        let outputs = net.forward(&batch.images()?.to_dtype(input)?)?;
        let predicted = outputs.argmax(1, false)?;
        correct += matches(&predicted, &batch.labels);
        total += batch.len();
    }
    println!(
        "Accuracy of the network on the {total} test images: {} %",
        100 * correct / total.max(1)
    );
    Ok(())
}

fn matches(predicted: &Tensor, labels: &Tensor) -> usize {
    let (p, l) = (predicted.to_vec_i64(), labels.to_vec_i64());
    p.iter().zip(&l).filter(|(a, b)| a == b).count()
}
