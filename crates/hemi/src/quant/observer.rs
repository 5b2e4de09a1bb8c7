//! Observers: the range of the values a layer sees during calibration or quantisation-aware
//! training, turned into a scale and zero point (PyTorch's `torch.ao.quantization.observer`).

use crate::cpu::qgemm::quant as k;
use crate::error::{Error, Result};

/// How an observer turns what it saw into a range.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ObserverKind {
    /// The smallest and largest value seen (`MinMaxObserver`).
    MinMax,
    /// Exponential moving averages of each batch's min and max with this averaging constant
    /// (`MovingAverageMinMaxObserver`, 0.01 by default).
    MovingAverage(f32),
    /// The `p` and `1 - p` quantiles (e.g. 0.9999) of a sample of the values seen: clips
    /// rare outliers.
    Percentile(f64),
    /// The clipping range (shrunk from min-max in 64 steps) that minimises the mean squared
    /// quantisation error on a sample of the values seen (the search `HistogramObserver`
    /// does, on the sample instead of a histogram).
    Mse,
}

impl ObserverKind {
    /// Parses `minmax`, `moving-average[:C]`, `percentile[:P]` (P in percent, default
    /// 99.99) or `mse`.
    pub fn parse(s: &str) -> Result<ObserverKind> {
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let num = |d: f64| -> Result<f64> {
            match arg {
                None => Ok(d),
                Some(a) => a
                    .parse::<f64>()
                    .map_err(|_| Error::arg("observer", format!("{s:?}: {a:?} is not a number"))),
            }
        };
        match name {
            "minmax" => Ok(ObserverKind::MinMax),
            "moving-average" => {
                let c = num(0.01)?;
                if !(c > 0.0 && c <= 1.0) {
                    return Err(Error::arg(
                        "observer",
                        format!("averaging constant {c} not in (0, 1]"),
                    ));
                }
                Ok(ObserverKind::MovingAverage(c as f32))
            }
            "percentile" => {
                let p = num(99.99)?;
                if !(p > 50.0 && p <= 100.0) {
                    return Err(Error::arg(
                        "observer",
                        format!("percentile {p} not in (50, 100]"),
                    ));
                }
                Ok(ObserverKind::Percentile(p / 100.0))
            }
            "mse" => Ok(ObserverKind::Mse),
            _ => Err(Error::arg(
                "observer",
                format!("unknown observer {s:?} (minmax, moving-average[:C], percentile[:P], mse)"),
            )),
        }
    }

    fn samples(self) -> bool {
        matches!(self, ObserverKind::Percentile(_) | ObserverKind::Mse)
    }
}

/// Values kept per batch for the sampling observers.
const SAMPLE_PER_BATCH: usize = 1 << 15;
/// Values kept in all.
const SAMPLE_MAX: usize = 1 << 21;

/// Records the range of the tensors it is shown.
#[derive(Clone, Debug)]
pub struct Observer {
    kind: ObserverKind,
    lo: f32,
    hi: f32,
    batches: usize,
    sample: Vec<f32>,
}

impl Observer {
    /// An observer that has seen nothing.
    pub fn new(kind: ObserverKind) -> Observer {
        Observer {
            kind,
            lo: 0.0,
            hi: 0.0,
            batches: 0,
            sample: Vec::new(),
        }
    }

    /// Its kind.
    pub fn kind(&self) -> ObserverKind {
        self.kind
    }

    /// Batches seen.
    pub fn batches(&self) -> usize {
        self.batches
    }

    /// Takes one batch of values into account (NaN ignored).
    pub fn observe(&mut self, x: &[f32]) {
        if x.is_empty() {
            return;
        }
        let (lo, hi) = k::min_max(x);
        match self.kind {
            ObserverKind::MovingAverage(c) if self.batches > 0 => {
                self.lo += c * (lo - self.lo);
                self.hi += c * (hi - self.hi);
            }
            ObserverKind::MovingAverage(_) => {
                self.lo = lo;
                self.hi = hi;
            }
            _ if self.batches == 0 => {
                self.lo = lo;
                self.hi = hi;
            }
            _ => {
                self.lo = self.lo.min(lo);
                self.hi = self.hi.max(hi);
            }
        }
        if self.kind.samples() && self.sample.len() < SAMPLE_MAX {
            let step = x.len().div_ceil(SAMPLE_PER_BATCH).max(1);
            // A fixed stride, offset by the batch count so that strided layouts are not
            // sampled at the same positions every time.
            let start = self.batches % step;
            self.sample
                .extend(x.iter().skip(start).step_by(step).filter(|v| !v.is_nan()));
        }
        self.batches += 1;
    }

    /// The range `(lo, hi)` the observer settles on (before widening to hold 0).
    pub fn range(&self) -> (f32, f32) {
        match self.kind {
            ObserverKind::MinMax | ObserverKind::MovingAverage(_) => (self.lo, self.hi),
            ObserverKind::Percentile(p) => {
                if self.sample.is_empty() {
                    return (self.lo, self.hi);
                }
                let mut s = self.sample.clone();
                s.sort_by(f32::total_cmp);
                let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
                (at(1.0 - p), at(p))
            }
            ObserverKind::Mse => self.mse_range(),
        }
    }

    fn mse_range(&self) -> (f32, f32) {
        let (lo0, hi0) = (self.lo.min(0.0), self.hi.max(0.0));
        if self.sample.is_empty() || hi0 - lo0 <= 0.0 {
            return (self.lo, self.hi);
        }
        let mut best = (f64::INFINITY, lo0, hi0);
        for step in 0..64 {
            let f = 1.0 - step as f32 / 80.0; // 1.0 down to 0.21
            let (lo, hi) = (lo0 * f, hi0 * f);
            let (scale, zp) = k::affine_qparams(lo, hi, 0, 255);
            let inv = 1.0 / scale;
            let err: f64 = self
                .sample
                .iter()
                .map(|&v| {
                    let q = k::quantize_one(v, inv, zp, 0, 255);
                    let d = ((q - zp) as f32 * scale - v) as f64;
                    d * d
                })
                .sum();
            if err < best.0 {
                best = (err, lo, hi);
            }
        }
        (best.1, best.2)
    }

    /// Scale and zero point for u8 activations over the range (PyTorch's
    /// `per_tensor_affine` arithmetic, the full 0..=255: hemi's INT8 GEMM has no 16-bit
    /// intermediate, so it needs no `reduce_range`).
    pub fn qparams_u8(&self) -> (f32, i32) {
        let (lo, hi) = self.range();
        k::affine_qparams(lo, hi, 0, 255)
    }

    /// The raw running range (for saving).
    pub fn raw_range(&self) -> (f32, f32) {
        (self.lo, self.hi)
    }
}
