//! Rounding F32 values into a half-precision dtype: to nearest-even (the precision
//! contract's default) or stochastically (llm.c's and pure-BF16 training's write-back of F32
//! master values into low-precision weights).
//!
//! Why stochastic rounding: an update smaller than half an ulp of the weight is lost every
//! time under nearest-even (a BF16 weight of 1.0 ignores every increment below 2^-9), so a
//! model trained without F32 masters stalls. Rounding up with probability equal to the
//! distance already covered keeps the expected weight equal to the F32 value, so small
//! updates survive on average.

pub use crate::dtype::convert::{stochastic_round_bf16, stochastic_round_f16, Rounding};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// Rounds F32 `values` (row-major, `shape`) into a new contiguous tensor of `dtype`.
///
/// F16 and BF16 round as `rounding` says; F32 is a copy and F64 an exact widening (there is
/// nothing to round). Under both roundings: representable values stay exact, NaN stays NaN,
/// ±inf stays ±inf, and a finite value beyond the dtype's largest finite value rounds as
/// nearest-even does (to the maximum or to inf), because there is no finite neighbour above
/// it to choose. `rng` is only drawn from for stochastic rounding into F16/BF16 (one
/// `next_u64` per F16 element, one per four BF16 elements).
pub fn round_f32_into(
    values: &[f32],
    shape: &[usize],
    dtype: DType,
    rounding: Rounding,
    rng: &mut Generator,
) -> Result<Tensor> {
    const OP: &str = "round_f32_into";
    let n: usize = shape.iter().product();
    if n != values.len() {
        return Err(Error::shape(
            OP,
            format!("{} values do not fill shape {shape:?}", values.len()),
        ));
    }
    let src = Tensor::from_f32_vec(values.to_vec(), shape, DType::F32)?;
    src.round_into(dtype, rounding, rng)
}

impl Tensor {
    /// This tensor's values (read as F32) rounded into a new contiguous tensor of `dtype`
    /// as `rounding` says, on the same device, outside autograd (see `round_f32_into` for
    /// the rules and the random draws).
    pub fn round_into(
        &self,
        dtype: DType,
        rounding: Rounding,
        rng: &mut Generator,
    ) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::dtype(
                "round_into",
                dtype,
                "rounds into float dtypes only",
            ));
        }
        let out = self
            .storage()
            .round_into(self.layout(), dtype, rounding, rng)?;
        Ok(Tensor::from_storage(
            std::sync::Arc::new(out),
            crate::tensor::Layout::contiguous(self.shape()),
        ))
    }
}
