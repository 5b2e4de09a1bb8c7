//! Dropout with a seeded generator.
//!
//! Inverted dropout, as PyTorch's: in training each element is kept with probability
//! `1 - p` and scaled by `1 / (1 - p)`, so the expected value is unchanged and eval mode is
//! the identity. The mask is drawn from the caller's `Generator`, one uniform draw per
//! element in row-major order of the logical shape (whatever the strides), so the same
//! seed gives the same mask.

use std::sync::Arc;

use crate::backend::map::BinaryOp;
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::{Layout, Tensor};

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
        // The factors 1/(1-p) or 0, in the compute type (F32, F64 for F64) so that the
        // scale is not rounded to the input's dtype; the output and the gradient are the
        // products, rounded once.
        let compute = dtype.compute_type();
        let storage = self.storage();
        let layout = Layout::contiguous(self.shape());
        let factor = Arc::new(storage.dropout_mask(self.numel(), p, rng, compute)?);
        let out = storage.binary(self.layout(), &factor, &layout, BinaryOp::Mul, dtype)?;
        Ok(Tensor::from_op(
            Arc::new(out),
            layout.clone(),
            OP,
            &[self],
            move |g| {
                let gi =
                    g.storage()
                        .binary(g.layout(), &factor, &layout, BinaryOp::Mul, g.dtype())?;
                Ok(vec![Some(Tensor::from_storage(
                    Arc::new(gi),
                    layout.clone(),
                ))])
            },
        ))
    }
}
