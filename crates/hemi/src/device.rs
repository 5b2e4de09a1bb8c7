//! Where a tensor's storage lives: the CPU, a CUDA GPU or a wgpu (Vulkan) GPU by ordinal, or
//! the naive reference backend. Every tensor carries its device; ops refuse to mix devices
//! (`Device::check_same`), and `Tensor::to_device` moves data between them.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A device: the host CPU, CUDA GPU number `n` (`cuda:n`), wgpu GPU number `n` (`gpu:n`), or
/// the naive backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Device {
    /// The host CPU (the default).
    #[default]
    Cpu,
    /// CUDA GPU number `n` (`cuda:n`); needs the `cuda` feature.
    Cuda(usize),
    /// GPU number `n` of the wgpu backend (`gpu:n`): the `n`-th Vulkan adapter (a real GPU,
    /// or Mesa's lavapipe on a machine without one); needs the `gpu` feature.
    Gpu(usize),
    /// The naive reference backend (`naive`, `crate::naive`): host memory, every primitive a
    /// plain scalar loop in f64 rounded into the dtype, implementing only the basic
    /// primitives (the rest are the default compositions). Slow on purpose: tests hold the
    /// CPU backend to it, and a new backend starts from a copy of it (DEVELOPERS.md).
    Naive,
}

impl Device {
    /// True for the host CPU.
    pub fn is_cpu(self) -> bool {
        self == Device::Cpu
    }

    /// True for a CUDA GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// True for a GPU of the wgpu backend.
    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Gpu(_))
    }

    /// Errors, naming both devices and the op, unless every device in `devices` is the same.
    pub fn check_same(op: &'static str, devices: &[Device]) -> Result<Device> {
        let first = devices.first().copied().unwrap_or_default();
        if let Some(other) = devices.iter().find(|d| **d != first) {
            return Err(Error::device(
                op,
                format!(
                    "expected all tensors on one device, found {first} and {other} \
                     (move one with to_device)"
                ),
            ));
        }
        Ok(first)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Gpu(n) => write!(f, "gpu:{n}"),
            Device::Naive => f.write_str("naive"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu`, `cuda` (device 0) and `cuda:N`, as PyTorch's `torch.device` does, and
    /// `gpu` (device 0) and `gpu:N` for the wgpu backend; `naive` (the reference backend).
    fn from_str(s: &str) -> Result<Device> {
        let bad = |why: &str| {
            Error::device(
                "device",
                format!(
                    "cannot parse {s:?} as a device ({why}); expected cpu, cuda, cuda:N, gpu, \
                     gpu:N or naive"
                ),
            )
        };
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "naive" => Ok(Device::Naive),
            "cuda" => Ok(Device::Cuda(0)),
            "gpu" => Ok(Device::Gpu(0)),
            t => {
                let (kind, n): (fn(usize) -> Device, &str) = match t.split_once(':') {
                    Some(("cuda", n)) => (Device::Cuda, n),
                    Some(("gpu", n)) => (Device::Gpu, n),
                    _ => return Err(bad("unknown device kind")),
                };
                n.parse::<usize>()
                    .ok()
                    .filter(|n| *n < 1 << 16)
                    .map(kind)
                    .ok_or_else(|| bad("the ordinal is not a small non-negative integer"))
            }
        }
    }
}
