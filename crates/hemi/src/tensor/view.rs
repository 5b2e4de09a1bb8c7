//! Views: new layouts over the same storage (reshape, permute, transpose, narrow,
//! broadcast, squeeze, unsqueeze), each with its backward next to it.

use super::layout::{contiguous_strides, resolve_dim, Layout};
use super::Tensor;
#[allow(unused_imports)]
use num_traits::{Float, One, Zero};

use crate::error::{Error, Result};

impl Tensor {
    /// The same elements in a new shape (a view when contiguous, a copy otherwise).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let n = super::layout::checked_numel("reshape", shape)?;
        if n != self.numel() {
            return Err(Error::shape(
                "reshape",
                format!(
                    "cannot reshape {:?} ({} elements) to {shape:?}",
                    self.shape(),
                    self.numel()
                ),
            ));
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let src = self.contiguous()?;
        let orig = self.shape().to_vec();
        let layout = Layout::new(
            shape.to_vec(),
            contiguous_strides(shape),
            src.layout().offset(),
        );
        Ok(src.new_view(layout, "reshape", move |g| {
            Ok(vec![Some(g.reshape(&orig)?)])
        }))
    }

    /// Flattens dims `start..=end` into one (as `torch.flatten`).
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        let s = resolve_dim("flatten", start, self.rank())?;
        let e = resolve_dim("flatten", end, self.rank())?;
        if s > e {
            return Err(Error::arg(
                "flatten",
                format!("start dim {s} after end dim {e}"),
            ));
        }
        let mut shape: Vec<usize> = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(&shape)
    }

    /// Reorders dims: output dim `i` is input dim `dims[i]`.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if dims.len() != rank
            || dims
                .iter()
                .any(|&d| d >= rank || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::shape(
                "permute",
                format!(
                    "{dims:?} is not a permutation of the dims of {:?}",
                    self.shape()
                ),
            ));
        }
        let l = self.layout();
        let shape = dims.iter().map(|&d| l.shape()[d]).collect();
        let strides = dims.iter().map(|&d| l.strides()[d]).collect();
        let mut inverse = vec![0; rank];
        for (i, &d) in dims.iter().enumerate() {
            inverse[d] = i;
        }
        Ok(self.new_view(
            Layout::new(shape, strides, l.offset()),
            "permute",
            move |g| Ok(vec![Some(g.permute(&inverse)?)]),
        ))
    }

    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let a = resolve_dim("transpose", d0, self.rank())?;
        let b = resolve_dim("transpose", d1, self.rank())?;
        let mut dims: Vec<usize> = (0..self.rank()).collect();
        dims.swap(a, b);
        self.permute(&dims)
    }

    /// Transpose of a 2-D tensor (the last two dims of a batched one).
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::shape(
                "t",
                format!("needs rank >= 2, got {:?}", self.shape()),
            ));
        }
        self.transpose(-2, -1)
    }

    /// Elements `start..start+len` along `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = resolve_dim("narrow", dim, self.rank())?;
        let size = self.shape()[d];
        if start + len > size {
            return Err(Error::shape(
                "narrow",
                format!(
                    "range {start}..{} past size {size} of dim {d} in {:?}",
                    start + len,
                    self.shape()
                ),
            ));
        }
        let l = self.layout();
        let mut shape = l.shape().to_vec();
        shape[d] = len;
        let offset = l.offset() + start * l.strides()[d];
        let full = self.shape().to_vec();
        Ok(self.new_view(
            Layout::new(shape, l.strides().to_vec(), offset),
            "narrow",
            move |g| Ok(vec![Some(g.pad_narrowed(d, start, &full)?)]),
        ))
    }

    /// Backward of narrow: `self` placed at `start` along `dim` in zeros of `full` shape
    /// (a concatenation with zero blocks on the same device; exact in every dtype).
    fn pad_narrowed(&self, dim: usize, start: usize, full: &[usize]) -> Result<Tensor> {
        let len = self.shape()[dim];
        let zeros = |n: usize| -> Result<Option<Tensor>> {
            if n == 0 {
                return Ok(None);
            }
            let mut shape = full.to_vec();
            shape[dim] = n;
            Ok(Some(
                Tensor::zeros(&shape, self.dtype())?.to_device(self.device())?,
            ))
        };
        let (before, after) = (zeros(start)?, zeros(full[dim] - start - len)?);
        let g = self.detach();
        let parts: Vec<&Tensor> = before.iter().chain([&g]).chain(after.iter()).collect();
        Tensor::cat(&parts, dim as isize)
    }

    /// This tensor expanded to `shape` by broadcasting (size-1 or missing leading dims
    /// repeat without copying). The backward sums over the broadcast dims.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let l = self.layout();
        if shape.len() < l.rank() {
            return Err(Error::shape(
                "broadcast_to",
                format!("cannot broadcast {:?} to {shape:?}", self.shape()),
            ));
        }
        let lead = shape.len() - l.rank();
        let mut strides = vec![0; shape.len()];
        for i in 0..l.rank() {
            let (src, dst) = (l.shape()[i], shape[lead + i]);
            strides[lead + i] = if src == dst {
                l.strides()[i]
            } else if src == 1 {
                0
            } else {
                return Err(Error::shape(
                    "broadcast_to",
                    format!("cannot broadcast {:?} to {shape:?}", self.shape()),
                ));
            };
        }
        let orig = self.shape().to_vec();
        Ok(self.new_view(
            Layout::new(shape.to_vec(), strides, l.offset()),
            "broadcast_to",
            move |g| Ok(vec![Some(g.sum_to_shape(&orig)?)]),
        ))
    }

    /// Removes dim `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("squeeze", dim, self.rank())?;
        if self.shape()[d] != 1 {
            return Err(Error::shape(
                "squeeze",
                format!(
                    "dim {d} of {:?} has size {}, not 1",
                    self.shape(),
                    self.shape()[d]
                ),
            ));
        }
        let l = self.layout();
        let mut shape = l.shape().to_vec();
        let mut strides = l.strides().to_vec();
        shape.remove(d);
        strides.remove(d);
        let orig = self.shape().to_vec();
        Ok(self.new_view(
            Layout::new(shape, strides, l.offset()),
            "squeeze",
            move |g| Ok(vec![Some(g.reshape(&orig)?)]),
        ))
    }

    /// Inserts a size-1 dim at `dim` (`0..=rank`, negative counts from the end).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("unsqueeze", dim, self.rank() + 1)?;
        let l = self.layout();
        let mut shape = l.shape().to_vec();
        let mut strides = l.strides().to_vec();
        let stride = if d < l.rank() {
            l.strides()[d] * l.shape()[d]
        } else {
            1
        };
        shape.insert(d, 1);
        strides.insert(d, stride);
        let orig = self.shape().to_vec();
        Ok(self.new_view(
            Layout::new(shape, strides, l.offset()),
            "unsqueeze",
            move |g| Ok(vec![Some(g.reshape(&orig)?)]),
        ))
    }
}
