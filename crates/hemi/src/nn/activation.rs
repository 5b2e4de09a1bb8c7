//! Activations, Flatten and Dropout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::pool::stateless;
use super::{Module, Visit, Visitor, VisitorMut};
use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;

/// `max(x, 0)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Relu;

/// GELU, exact (erf) form, or the tanh approximation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Gelu {
    /// Use the tanh approximation (PyTorch's `approximate='tanh'`) instead of the exact erf
    /// form.
    pub tanh_approximation: bool,
}

/// Flattens dims `1..` (PyTorch's `nn.Flatten()` default start_dim=1).
#[derive(Clone, Copy, Debug, Default)]
pub struct Flatten;

stateless!(Relu, |_s, x| x.relu());
stateless!(Gelu, |s, x| if s.tanh_approximation {
    x.gelu_tanh()
} else {
    x.gelu()
});
stateless!(Flatten, |_s, x| x.flatten(1, -1));

/// Inverted dropout with probability `p`, drawing masks from its own seeded generator.
pub struct Dropout {
    /// Probability of zeroing an element in training, in `[0, 1]`; kept elements are scaled
    /// by `1/(1-p)`.
    pub p: f64,
    /// Shared with the layer's replicas (`nn::Replicate`), whose recompute draws from it.
    pub(crate) rng: Arc<Mutex<Generator>>,
    pub(crate) training: AtomicBool,
}

impl Dropout {
    /// A dropout layer with probability `p` (in `[0, 1]`, else [`Error::Arg`]) whose masks
    /// come from a generator seeded with `seed`; starts in training mode, and is the
    /// identity in eval mode.
    pub fn new(p: f64, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::arg(
                "Dropout",
                format!("p must be in [0, 1], got {p}"),
            ));
        }
        Ok(Dropout {
            p,
            rng: Arc::new(Mutex::new(Generator::new(seed))),
            training: AtomicBool::new(true),
        })
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut rng = self
            .rng
            .lock()
            .map_err(|_| Error::Msg("Dropout: generator lock poisoned".into()))?;
        x.dropout(self.p, self.training.load(Ordering::Relaxed), &mut rng)
    }
}

/// No tensors: its generator and its training flag.
impl Visit for Dropout {
    fn visit<'a>(&'a self, v: &mut dyn Visitor<'a>) {
        v.generator(&self.rng);
        v.training(&self.training);
    }
    fn visit_mut<'a>(&'a mut self, _: &mut dyn VisitorMut<'a>) {}
}
