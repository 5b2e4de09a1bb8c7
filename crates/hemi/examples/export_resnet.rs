//! Writes a hemi ResNet's state_dict (BN affine and running statistics randomised, so that
//! eval-mode BN matters) and, beside it, an input batch and hemi's eval-mode F32 logits, so
//! that `bench/resnet_interop_fixtures.py --check-hemi OUT_DIR` can load the weights into
//! torchvision with `strict=True` and compare the logits.
//!
//! cargo run --release -p hemi --example export_resnet -- ARCH OUT_DIR [CLASSES] [SIZE]
//!
//! ARCH: one of resnet18/34/50 (torchvision's layout) or resnet20/32/56 (CIFAR, option A,
//! checked against the PyTorch definition in the script). Defaults: 1000 classes and
//! 64×64 images for the ImageNet networks, 10 classes and 32×32 for the CIFAR ones.

use std::collections::HashMap;

use hemi::io::save_safetensors;
use hemi::models::resnet;
use hemi::nn::Module;
use hemi::{DType, Generator, Result, Tensor};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arch = args.first().map_or("resnet18", String::as_str);
    let out = std::path::Path::new(args.get(1).map_or("target/export-resnet", String::as_str));
    let cifar = matches!(arch, "resnet20" | "resnet32" | "resnet56");
    let num = |i: usize, default: usize| -> Result<usize> {
        args.get(i).map_or(Ok(default), |s| {
            s.parse()
                .map_err(|e| hemi::Error::Msg(format!("argument {i}: {s:?}: {e}")))
        })
    };
    let classes = num(2, if cifar { 10 } else { 1000 })?;
    let size = num(3, if cifar { 32 } else { 64 })?;

    let mut rng = Generator::new(7);
    let mut net = resnet(arch, classes, &mut rng)?;
    // BN weight, running_var in [0.5, 1.5); bias, running_mean in [-0.25, 0.25); a count.
    let state: Vec<(String, Tensor)> = net
        .state_dict()
        .into_iter()
        .map(|(name, t)| {
            let leaf = name.rsplit('.').next().unwrap_or("");
            let bn =
                name.contains(".bn") || name.starts_with("bn") || name.contains("downsample.1");
            let v = match leaf {
                "num_batches_tracked" => Tensor::from_vec(vec![12_345i64], &[])?,
                "weight" | "running_var" if bn => {
                    Tensor::rand(t.shape(), 0.5, 1.5, DType::F32, &mut rng)?
                }
                "bias" | "running_mean" if bn => {
                    Tensor::rand(t.shape(), -0.25, 0.25, DType::F32, &mut rng)?
                }
                _ => t,
            };
            Ok((name, v))
        })
        .collect::<Result<_>>()?;
    hemi::io::load_state_dict_strict(&mut net, &state)?;
    net.set_training(false);

    let meta = HashMap::from([
        ("arch".to_string(), arch.to_string()),
        ("num_classes".to_string(), classes.to_string()),
    ]);
    save_safetensors(
        &out.join("model.safetensors"),
        &net.state_dict(),
        Some(meta),
    )?;
    let x = Tensor::randn(
        &[2, 3, size, size],
        0.0,
        1.0,
        DType::F32,
        &mut Generator::new(8),
    )?;
    let logits = {
        let _g = hemi::no_grad();
        net.forward(&x)?
    };
    save_safetensors(
        &out.join("io.safetensors"),
        &[("x".into(), x), ("logits".into(), logits)],
        None,
    )?;
    println!(
        "wrote {}/model.safetensors ({arch}, {classes} classes) and io.safetensors",
        out.display()
    );
    Ok(())
}
