//! Stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight
//! decay: PyTorch's `torch.optim.SGD` update rule, step for step.

use super::optimizer::{
    check_decay_mask, check_grads, check_nonneg, check_params, state_zeros, Optimizer,
    OptimizerState, StateBuffer, StateReader,
};
use crate::backend::train::{SgdFlags, SgdScalars};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Hyper-parameters of `Sgd` (PyTorch's names and defaults; PyTorch has no default lr, hemi
/// takes the documents' 0.001).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (hemi's default 0.001, the documents').
    pub lr: f64,
    /// Momentum factor (default 0: plain SGD; the documents use 0.9).
    pub momentum: f64,
    /// Dampening of the momentum buffer's update, `buf = momentum * buf + (1 - dampening) *
    /// g` (default 0).
    pub dampening: f64,
    /// L2 penalty: `weight_decay * p` is added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and no dampening, as in PyTorch).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    fn validate(&self, op: &'static str) -> Result<()> {
        check_nonneg(op, "learning rate", self.lr)?;
        check_nonneg(op, "momentum", self.momentum)?;
        check_nonneg(op, "weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(Error::arg(
                op,
                format!("invalid dampening: {}", self.dampening),
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::arg(
                op,
                format!(
                    "Nesterov momentum requires a momentum and zero dampening (momentum {}, dampening {})",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }
}

/// SGD over a list of parameters. For each parameter `p` with gradient `g` (all in F32):
///
/// ```text
/// g = g + weight_decay * p                         (if weight_decay != 0)
/// b = g                                            (first step with momentum != 0)
/// b = momentum * b + (1 - dampening) * g           (later steps)
/// g = g + momentum * b   (nesterov)   or   g = b   (otherwise)
/// p = p - lr * g
/// ```
///
/// The F32 arithmetic is PyTorch's CPU arithmetic, bit for bit (`tests/models/torch_parity.rs`):
/// each `x + a * y` above is one fused multiply-add, `momentum * b` is rounded on its own,
/// and the hyper-parameters are rounded to F32 once, as ATen does with Python floats.
pub struct Sgd {
    params: Vec<Tensor>,
    config: SgdConfig,
    /// One F32 momentum buffer per parameter, created by its first step with a gradient.
    /// F32, shaped and placed like the parameter.
    momentum_buffers: Vec<Option<Tensor>>,
    /// Whether weight decay applies to each parameter (`set_weight_decay_mask`).
    decay: Vec<bool>,
}

impl Sgd {
    /// Errors on invalid hyper-parameters (negative lr, nesterov without momentum or with
    /// dampening) and on parameters that are not whole F32/F16/BF16 leaves.
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Result<Sgd> {
        config.validate("Sgd::new")?;
        check_params("Sgd::new", &params)?;
        let momentum_buffers = vec![None; params.len()];
        let decay = vec![true; params.len()];
        Ok(Sgd {
            params,
            config,
            momentum_buffers,
            decay,
        })
    }

    /// The hyper-parameters in use (the lr as last set, e.g. by a schedule).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// Parameter `i`'s momentum buffer (F32, row-major), once its first step created it.
    /// A snapshot: later steps do not change it.
    pub fn momentum_buffer(&self, i: usize) -> Option<Tensor> {
        self.momentum_buffers.get(i)?.as_ref().map(Tensor::detach)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        check_grads("Sgd::step", &self.params)?;
        // Python floats reach ATen as double Scalars, which the F32 kernels cast to float.
        let c = &self.config;
        let scalars = SgdScalars {
            neg_lr: (-c.lr) as f32,
            weight_decay: c.weight_decay as f32,
            momentum: c.momentum as f32,
            keep: (1.0 - c.dampening) as f32,
        };
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = p.grad() else {
                continue;
            };
            let c = &self.config;
            let momentum = c.momentum != 0.0;
            let first = self.momentum_buffers[i].is_none();
            if momentum && first {
                self.momentum_buffers[i] = Some(state_zeros(p)?);
            }
            let f = SgdFlags {
                weight_decay: c.weight_decay != 0.0 && self.decay[i],
                momentum,
                first,
                nesterov: c.nesterov,
            };
            // In place: the parameter's buffer is copied first only when another handle
            // shares it (`with_storage_mut`).
            let gs = g.storage();
            let (pl, gl) = (p.layout(), g.layout());
            match &self.momentum_buffers[i] {
                Some(b) if momentum => b.with_storage_mut(|b| {
                    p.with_storage_mut(|ps| ps.sgd_step(pl, (&gs, gl), Some(b), &scalars, f))
                })?,
                _ => p.with_storage_mut(|ps| ps.sgd_step(pl, (&gs, gl), None, &scalars, f))?,
            }
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn state_bytes(&self) -> usize {
        self.momentum_buffers
            .iter()
            .flatten()
            .map(|b| b.numel() * 4)
            .sum()
    }

    fn state_dict(&self) -> OptimizerState {
        let c = &self.config;
        let scalars = vec![
            ("num_params".to_string(), self.params.len() as f64),
            ("lr".to_string(), c.lr),
            ("momentum".to_string(), c.momentum),
            ("dampening".to_string(), c.dampening),
            ("weight_decay".to_string(), c.weight_decay),
            ("nesterov".to_string(), f64::from(u8::from(c.nesterov))),
        ];
        let buffers = (self.params.iter().zip(&self.momentum_buffers).enumerate())
            .filter_map(|(i, (p, b))| {
                Some(StateBuffer {
                    name: format!("{i}.momentum_buffer"),
                    shape: p.shape().to_vec(),
                    data: b.as_ref()?.to_vec_f32(),
                })
            })
            .collect();
        OptimizerState {
            optimizer: "sgd".to_string(),
            scalars,
            buffers,
        }
    }

    fn set_weight_decay_mask(&mut self, decay: &[bool]) -> Result<()> {
        check_decay_mask("Sgd::set_weight_decay_mask", decay, self.params.len())?;
        self.decay = decay.to_vec();
        Ok(())
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        const OP: &str = "Sgd::load_state_dict";
        let mut r = StateReader::new(OP, state, "sgd", self.params.len())?;
        let config = SgdConfig {
            lr: r.scalar("lr")?,
            momentum: r.scalar("momentum")?,
            dampening: r.scalar("dampening")?,
            weight_decay: r.scalar("weight_decay")?,
            nesterov: r.flag("nesterov")?,
        };
        config.validate(OP)?;
        let buffers = (self.params.iter().enumerate())
            .map(|(i, p)| r.buffer(i, "momentum_buffer", p))
            .collect::<Result<Vec<_>>>()?;
        r.finish()?;
        self.config = config;
        self.momentum_buffers = buffers;
        Ok(())
    }
}
