//! Writes a CifarNet checkpoint and, beside it, inputs and hemi's logits for them, so that
//! `bench/torch_check_checkpoint.py` can load the weights into PyTorch's network with
//! `strict=True` and compare the logits.
//!
//! cargo run --release -p hemi --example export_cifarnet -- OUT_DIR

use hemi::io::save_safetensors;
use hemi::models::CifarNet;
use hemi::nn::Module;
use hemi::{DType, Generator, Result, Tensor};

fn main() -> Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/export".into());
    let out = std::path::Path::new(&out);
    let net = CifarNet::cifar10(&mut Generator::new(0))?;
    save_safetensors(&out.join("model.safetensors"), &net.state_dict(), None)?;
    let x = Tensor::randn(
        &[4, 3, 32, 32],
        0.0,
        1.0,
        DType::F32,
        &mut Generator::new(1),
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
        "wrote {}/model.safetensors and io.safetensors",
        out.display()
    );
    Ok(())
}
