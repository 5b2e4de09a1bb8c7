//! PyTorch's default initialisations, drawn from a caller's seeded generator.

use crate::dtype::DType;
use crate::error::Result;
use crate::rng::Generator;
use crate::tensor::Tensor;

/// `kaiming_uniform_(w, a=√5)`, PyTorch's default for Linear and Conv weights: uniform in
/// ±gain·√(3/fan_in) with gain = √(2/(1+a²)) = √(1/3), i.e. ±1/√fan_in.
pub fn kaiming_uniform_default(
    shape: &[usize],
    fan_in: usize,
    rng: &mut Generator,
) -> Result<Tensor> {
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    Tensor::rand(shape, -bound, bound, DType::F32, rng)
}

/// PyTorch's default bias init: uniform in ±1/√fan_in.
pub fn bias_uniform(n: usize, fan_in: usize, rng: &mut Generator) -> Result<Tensor> {
    let bound = if fan_in > 0 {
        1.0 / (fan_in as f64).sqrt()
    } else {
        0.0
    };
    Tensor::rand(&[n], -bound, bound, DType::F32, rng)
}

/// `kaiming_normal_(w, mode="fan_out", nonlinearity="relu")`, torchvision's ResNet conv
/// init: normal with std = √(2 / fan_out), fan_out = out_channels·kh·kw (`shape[0]` times
/// the receptive field, the product of `shape[2..]`).
pub fn kaiming_normal_fan_out(shape: &[usize], rng: &mut Generator) -> Result<Tensor> {
    let fan_out = shape.first().copied().unwrap_or(1) * shape.iter().skip(2).product::<usize>();
    let std = (2.0 / fan_out.max(1) as f64).sqrt();
    Tensor::randn(shape, 0.0, std, DType::F32, rng)
}
