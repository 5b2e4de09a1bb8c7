//! `NnOps` of the naive backend (matmul, the convolution and its two backwards, max
//! pooling), and the areas it writes nothing of (`LossOps`, `OptimOps`): the direct
//! definitions as nested loops, sums in f64 rounded once.

use super::NaiveStorage;
use crate::backend::loss::LossOps;
use crate::backend::nn::{Conv2dGeom, Indices, MaxPool2d, NnOps, Opt, Pool2dGeom};
use crate::backend::train::OptimOps;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::Layout;

/// Where element `[b.., 0, 0]` of the matrix operand `l` sits for batch element `bi` of
/// `batch` (the broadcast batch shape; `l`'s batch dims align from the right, size 1
/// broadcasts).
fn batch_offset(l: &Layout, batch: &[usize], bi: usize) -> usize {
    let own = l.rank() - 2;
    let mut pos = l.offset();
    let mut rest = bi;
    for d in (0..batch.len()).rev() {
        let i = rest % batch[d];
        rest /= batch[d];
        if let Some(ld) = (d + own).checked_sub(batch.len()) {
            if l.shape()[ld] != 1 {
                pos += i * l.strides()[ld];
            }
        }
    }
    pos
}

/// Input row (or column) `o * stride + k * dilation - padding` of output position `o` and
/// tap `k`, when it lies inside `0..size`.
fn tap(
    o: usize,
    k: usize,
    stride: usize,
    dilation: usize,
    pad: usize,
    size: usize,
) -> Option<usize> {
    (o * stride + k * dilation)
        .checked_sub(pad)
        .filter(|&i| i < size)
}

/// Calls `f(x_index, w_index, y_index)` for every multiply-add of the convolution `g`
/// (row-major input, weight and output): the one loop nest the forward and both backwards
/// share.
fn conv_taps(g: &Conv2dGeom, mut f: impl FnMut(usize, usize, usize)) {
    let (cin_g, cout_g) = (g.c_in / g.groups, g.c_out_g());
    for n in 0..g.n {
        for co in 0..g.c_out {
            let group = co / cout_g;
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let y = ((n * g.c_out + co) * g.h_out + oh) * g.w_out + ow;
                    for cl in 0..cin_g {
                        let ci = group * cin_g + cl;
                        for kh in 0..g.kh {
                            let Some(ih) = tap(oh, kh, g.stride.0, g.dilation.0, g.padding.0, g.h)
                            else {
                                continue;
                            };
                            for kw in 0..g.kw {
                                let Some(iw) =
                                    tap(ow, kw, g.stride.1, g.dilation.1, g.padding.1, g.w)
                                else {
                                    continue;
                                };
                                let x = ((n * g.c_in + ci) * g.h + ih) * g.w + iw;
                                let w = ((co * cin_g + cl) * g.kh + kh) * g.kw + kw;
                                f(x, w, y);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// What `max_pool2d` keeps for its backward: the flat input position (plane included) of
/// each output's maximum.
struct Argmax(Vec<usize>);

/// The error of a primitive that is waiting for its default composition.
impl NnOps for NaiveStorage {
    fn matmul(
        &self,
        la: &Layout,
        rhs: &Self,
        lb: &Layout,
        bias: Opt<'_, Self>,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let (ra, rb) = (la.rank(), lb.rank());
        let batch = broadcast_shapes("matmul", &la.shape()[..ra - 2], &lb.shape()[..rb - 2])?;
        let (m, k, n) = (la.shape()[ra - 2], la.shape()[ra - 1], lb.shape()[rb - 1]);
        let (sa, sb) = (&la.strides()[ra - 2..], &lb.strides()[rb - 2..]);
        let bias = bias.map(|(b, l)| b.read_in(l, c));
        let count: usize = batch.iter().product();
        let mut y = Vec::with_capacity(count * m * n);
        for bi in 0..count {
            let (a0, b0) = (batch_offset(la, &batch, bi), batch_offset(lb, &batch, bi));
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0;
                    for p in 0..k {
                        let a = super::round(self.data[a0 + i * sa[0] + p * sa[1]], c);
                        let b = super::round(rhs.data[b0 + p * sb[0] + j * sb[1]], c);
                        acc += a * b;
                    }
                    y.push(acc + bias.as_ref().map_or(0.0, |b| b[j]));
                }
            }
        }
        Ok(NaiveStorage::from_f64(y, out))
    }

    fn conv2d(
        &self,
        lx: &Layout,
        w: &Self,
        lw: &Layout,
        bias: Opt<'_, Self>,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let (x, w) = (self.read_in(lx, c), w.read_in(lw, c));
        let mut y = vec![0.0; g.n * g.out_image()];
        if let Some((b, lb)) = bias {
            let b = b.read_in(lb, c);
            for (i, v) in y.iter_mut().enumerate() {
                *v = b[i / g.l() % g.c_out];
            }
        }
        conv_taps(g, |xi, wi, yi| y[yi] += x[xi] * w[wi]);
        Ok(NaiveStorage::from_f64(y, out))
    }

    fn conv2d_backward_input(
        &self,
        ldy: &Layout,
        w: &Self,
        lw: &Layout,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let (dy, w) = (self.read_in(ldy, c), w.read_in(lw, c));
        let mut dx = vec![0.0; g.n * g.in_image()];
        conv_taps(g, |xi, wi, yi| dx[xi] += dy[yi] * w[wi]);
        Ok(NaiveStorage::from_f64(dx, out))
    }

    fn conv2d_backward_weight(
        &self,
        lx: &Layout,
        dy: &Self,
        ldy: &Layout,
        g: &Conv2dGeom,
        out: DType,
    ) -> Result<Self> {
        let c = out.compute_type();
        let (x, dy) = (self.read_in(lx, c), dy.read_in(ldy, c));
        let mut dw = vec![0.0; g.weight_len()];
        conv_taps(g, |xi, wi, yi| dw[wi] += x[xi] * dy[yi]);
        Ok(NaiveStorage::from_f64(dw, out))
    }

    fn max_pool2d(
        &self,
        l: &Layout,
        g: &Pool2dGeom,
        with_indices: bool,
    ) -> Result<MaxPool2d<Self>> {
        let x = self.read(l);
        let (mut y, mut at) = (Vec::new(), Vec::new());
        for p in 0..g.planes {
            let plane = p * g.in_plane();
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let rows =
                        (0..g.kernel.0).filter_map(|k| tap(oh, k, g.stride.0, 1, g.padding.0, g.h));
                    let (mut best, mut arg, mut nan) = (f64::NEG_INFINITY, None, None);
                    for ih in rows {
                        let cols = (0..g.kernel.1)
                            .filter_map(|k| tap(ow, k, g.stride.1, 1, g.padding.1, g.w));
                        for iw in cols {
                            let (i, v) = (ih * g.w + iw, x[plane + ih * g.w + iw]);
                            // The first maximum wins ties; a NaN wins, the last one (PyTorch's
                            // rule, as the CPU's).
                            if v.is_nan() {
                                nan = Some(i);
                            } else if arg.is_none() || v > best {
                                (best, arg) = (v, Some(i));
                            }
                        }
                    }
                    let (v, i) = match nan {
                        Some(i) => (f64::NAN, i),
                        None => (best, arg.expect("a window holds at least one input")),
                    };
                    y.push(v);
                    at.push(plane + i);
                }
            }
        }
        let indices = with_indices.then(|| {
            let flat = at.iter().map(|&i| (i % g.in_plane()) as f64).collect();
            NaiveStorage::exact(flat, DType::I64)
        });
        Ok(MaxPool2d {
            out: NaiveStorage::exact(y, self.dtype),
            argmax: Indices::new(Argmax(at)),
            indices,
        })
    }

    fn max_pool2d_backward(
        &self,
        ldy: &Layout,
        argmax: &Indices,
        g: &Pool2dGeom,
        out: DType,
    ) -> Result<Self> {
        let Argmax(at) = argmax
            .get()
            .ok_or_else(|| Error::arg("max_pool2d_backward", "indices of another backend"))?;
        let dy = self.read_in(ldy, out.compute_type());
        let mut dx = vec![0.0; g.planes * g.in_plane()];
        for (&i, &d) in at.iter().zip(&dy) {
            dx[i] += d;
        }
        Ok(NaiveStorage::from_f64(dx, out))
    }
}

impl LossOps for NaiveStorage {}

impl OptimOps for NaiveStorage {}
