//! Dropout with a seeded generator.
//!
//! Inverted dropout, as PyTorch's: in training each element is kept with probability
//! `1 - p` and scaled by `1 / (1 - p)`, so the expected value is unchanged and eval mode is
//! the identity. The mask is drawn from the caller's `Generator`, one uniform draw per
//! element in row-major order of the logical shape (whatever the strides), so the same
//! seed gives the same mask.

#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use super::elementwise::zip_map;
use crate::dtype::WithDType as _;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

impl Tensor {
    /// Inverted dropout with drop probability `p` in `[0, 1]`.
    ///
    /// Returns `self` unchanged (drawing nothing) when `!training` or `p == 0`, and zeros
    /// times the input when `p == 1` (as PyTorch, so an infinite input gives NaN). The
    /// output has the input's dtype; the backward multiplies the gradient by the same
    /// mask and scale.
    pub fn dropout(&self, p: f64, training: bool, rng: &mut Generator) -> Result<Tensor> {
        const OP: &str = "dropout";
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::arg(
                OP,
                format!("probability must be in [0, 1], got {p}"),
            ));
        }
        if !self.dtype().is_float() {
            return Err(Error::dtype(
                OP,
                self.dtype(),
                format!("expected a float tensor, got shape {:?}", self.shape()),
            ));
        }
        if !training || p == 0.0 || self.numel() == 0 {
            return Ok(self.clone());
        }
        let dtype = self.dtype();
        crate::with_compute!(dtype, C => {
            // factor = mask / (1 - p): 1/(1-p) where kept, 0 where dropped.
            let factor: Vec<C> = if p == 1.0 {
                vec![C::zero(); self.numel()]
            } else {
                let scale = C::from_f64(1.0 / (1.0 - p));
                (0..self.numel())
                    .map(|_| if rng.uniform_f64() >= p { scale } else { C::zero() })
                    .collect()
            };
            let out = self.with_values::<C, _>(|x| zip_map(x, &factor, |x, f| x * f));
            let shape = self.shape().to_vec();
            Ok(Tensor::from_compute(out, self.shape(), dtype, OP, &[self], move |g| {
                let gi = g.with_values::<C, _>(|g| zip_map(g, &factor, |g, f| g * f));
                Ok(vec![Some(Tensor::from_values(gi, &shape, g.dtype()))])
            }))
        })
    }
}
