//! Plain F64 convolutions by their definitions: the references the fast routes are tested
//! against.

use crate::backend::nn::Conv2dGeom;

/// Plain direct convolution (f64), the reference the fast path is tested against.
pub fn conv2d_reference(x: &[f64], w: &[f64], bias: Option<&[f64]>, g: &Conv2dGeom) -> Vec<f64> {
    let mut y = vec![0.0; g.n * g.out_image()];
    let (cig, m) = (g.c_in / g.groups, g.c_out_g());
    for n in 0..g.n {
        for co in 0..g.c_out {
            let grp = co / m;
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let mut s = bias.map_or(0.0, |b| b[co]);
                    for ci in 0..cig {
                        let c = grp * cig + ci;
                        for ki in 0..g.kh {
                            for kj in 0..g.kw {
                                let ih = (oh * g.stride.0 + ki * g.dilation.0) as isize
                                    - g.padding.0 as isize;
                                let iw = (ow * g.stride.1 + kj * g.dilation.1) as isize
                                    - g.padding.1 as isize;
                                if ih < 0 || iw < 0 || ih >= g.h as isize || iw >= g.w as isize {
                                    continue;
                                }
                                let xv =
                                    x[((n * g.c_in + c) * g.h + ih as usize) * g.w + iw as usize];
                                let wv = w[((co * cig + ci) * g.kh + ki) * g.kw + kj];
                                s += xv * wv;
                            }
                        }
                    }
                    y[((n * g.c_out + co) * g.h_out + oh) * g.w_out + ow] = s;
                }
            }
        }
    }
    y
}

/// The weight gradient by its definition in F64, `dw[o][c][ki][kj] = Σ_images Σ_pixels
/// dy · x`, and the sum of the terms' magnitudes of each element (for error bounds): the
/// reference the fast weight gradients are tested against. Ungrouped convolutions.
pub fn conv2d_weight_grad_reference<V: Copy + Into<f64>>(
    x: &[V],
    dy: &[V],
    g: &Conv2dGeom,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(g.groups, 1, "conv2d_weight_grad_reference: ungrouped only");
    let (mut dw, mut mag) = (vec![0.0; g.weight_len()], vec![0.0; g.weight_len()]);
    for i in 0..g.n {
        for o in 0..g.c_out {
            for c in 0..g.c_in {
                for ki in 0..g.kh {
                    for kj in 0..g.kw {
                        let at = ((o * g.c_in + c) * g.kh + ki) * g.kw + kj;
                        for oh in 0..g.h_out {
                            for ow in 0..g.w_out {
                                let ih = (oh * g.stride.0 + ki * g.dilation.0) as isize
                                    - g.padding.0 as isize;
                                let iw = (ow * g.stride.1 + kj * g.dilation.1) as isize
                                    - g.padding.1 as isize;
                                if ih < 0 || iw < 0 || ih >= g.h as isize || iw >= g.w as isize {
                                    continue;
                                }
                                let xv: f64 = x[i * g.in_image()
                                    + (c * g.h + ih as usize) * g.w
                                    + iw as usize]
                                    .into();
                                let dv: f64 = dy
                                    [i * g.out_image() + (o * g.h_out + oh) * g.w_out + ow]
                                    .into();
                                dw[at] += xv * dv;
                                mag[at] += (xv * dv).abs();
                            }
                        }
                    }
                }
            }
        }
    }
    (dw, mag)
}
