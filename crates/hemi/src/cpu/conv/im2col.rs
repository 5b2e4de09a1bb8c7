//! The column matrix of a convolution: `im2col` unfolds an image into it (a row per
//! (channel, kernel row, kernel column), a column per output pixel), `col2im` adds one back
//! into an image (the adjoint). Used by the im2col + GEMM route, the fused block and the
//! input gradient of strided convolutions.

use crate::backend::nn::Conv2dGeom;
use crate::dtype::FloatDType;

/// The outputs `o` in `[0, out)` whose input coordinate `o*stride + off` lies in `[0, size)`,
/// as a half-open range (so the copy loops need no bounds tests).
#[doc(hidden)]
pub fn valid_range(out: usize, size: usize, stride: usize, off: isize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
    let room = size as isize - off;
    let hi = if room <= 0 { 0 } else { (room + s - 1) / s };
    let hi = (hi as usize).min(out);
    ((lo as usize).min(hi), hi)
}

/// Calls `f(row, c, off_h, off_w)` for each row (c, ki, kj) of the column matrix: output
/// pixel (oh, ow) of that row reads input pixel (oh*sh + off_h, ow*sw + off_w) of plane c.
#[inline]
fn for_each_col_row(g: &Conv2dGeom, mut f: impl FnMut(usize, usize, isize, isize)) {
    let (ph, pw) = (g.padding.0 as isize, g.padding.1 as isize);
    for c in 0..g.c_in {
        for ki in 0..g.kh {
            for kj in 0..g.kw {
                let row = (c * g.kh + ki) * g.kw + kj;
                let off_h = (ki * g.dilation.0) as isize - ph;
                let off_w = (kj * g.dilation.1) as isize - pw;
                f(row, c, off_h, off_w);
            }
        }
    }
}

/// Unfolds one image `x [c_in, h, w]` into `col [c_in*kh*kw, h_out*w_out]` (zeros where the
/// window reads padding).
pub fn im2col<C: Copy + Default>(x: &[C], col: &mut [C], g: &Conv2dGeom) {
    im2col_ld(x, col, g.l(), g)
}

/// `im2col` into the first `h_out*w_out` columns of a matrix with row stride `ld` (several
/// images side by side: image `i`'s columns start at `col[i * L..]`).
pub fn im2col_ld<C: Copy + Default>(x: &[C], col: &mut [C], ld: usize, g: &Conv2dGeom) {
    let (l, wo, (sh, sw)) = (g.l(), g.w_out, g.stride);
    // Stride 1 with output rows as long as input rows ("same" padding): row (c, ki, kj) of
    // the column matrix is plane c shifted by off_h rows and off_w columns, so its valid
    // part is one run of the flattened plane; only the few columns that wrap around from the
    // neighbouring row (|off_w| per row) are zeroed afterwards. A copy per plane instead of
    // one per output row: ResNet's 8×8 and 16×16 planes made im2col a call to memmove per
    // 8 or 16 elements.
    let flat = (sh, sw) == (1, 1) && wo == g.w;
    for_each_col_row(g, |row, c, off_h, off_w| {
        let dst = &mut col[row * ld..row * ld + l];
        let plane = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
        let (oh_lo, oh_hi) = valid_range(g.h_out, g.h, sh, off_h);
        let (ow_lo, ow_hi) = valid_range(wo, g.w, sw, off_w);
        if flat {
            if oh_lo >= oh_hi || ow_lo >= ow_hi {
                dst.fill(C::default());
                return;
            }
            // Output pixels a..b (flattened) read input pixels a + shift..b + shift.
            let (a, b) = (oh_lo * wo + ow_lo, (oh_hi - 1) * wo + ow_hi);
            let from =
                ((oh_lo as isize + off_h) * g.w as isize + (ow_lo as isize + off_w)) as usize;
            dst[..a].fill(C::default());
            dst[a..b].copy_from_slice(&plane[from..from + (b - a)]);
            dst[b..].fill(C::default());
            // Column by column down the rows (a fill per row would be a call to memset
            // per element or two).
            for ow in (0..ow_lo).chain(ow_hi..wo) {
                for oh in oh_lo..oh_hi {
                    dst[oh * wo + ow] = C::default();
                }
            }
            return;
        }
        dst[..oh_lo * wo].fill(C::default());
        dst[oh_hi * wo..].fill(C::default());
        for oh in oh_lo..oh_hi {
            let out = &mut dst[oh * wo..(oh + 1) * wo];
            out[..ow_lo].fill(C::default());
            out[ow_hi..].fill(C::default());
            if ow_lo == ow_hi {
                continue;
            }
            let ih = ((oh * sh) as isize + off_h) as usize;
            let iw0 = ((ow_lo * sw) as isize + off_w) as usize;
            let src = &plane[ih * g.w..(ih + 1) * g.w];
            let out = &mut out[ow_lo..ow_hi];
            if sw == 1 {
                out.copy_from_slice(&src[iw0..iw0 + out.len()]);
            } else {
                // An iterator, not `src[iw0 + j * sw]`: no bounds check per element.
                for (o, &v) in out.iter_mut().zip(src[iw0..].iter().step_by(sw)) {
                    *o = v;
                }
            }
        }
    });
}

/// The adjoint of `im2col`: adds each column entry into the input pixel it was read from.
/// `dx [c_in, h, w]` is accumulated into (callers pass zeros).
pub fn col2im<C: FloatDType>(col: &[C], dx: &mut [C], g: &Conv2dGeom) {
    col2im_ld(col, dx, g.l(), g)
}

/// `col2im` from the first `h_out*w_out` columns of a matrix with row stride `ld`.
pub fn col2im_ld<C: FloatDType>(col: &[C], dx: &mut [C], ld: usize, g: &Conv2dGeom) {
    let (l, wo, (sh, sw)) = (g.l(), g.w_out, g.stride);
    for_each_col_row(g, |row, c, off_h, off_w| {
        let src = &col[row * ld..row * ld + l];
        let plane = &mut dx[c * g.h * g.w..(c + 1) * g.h * g.w];
        let (oh_lo, oh_hi) = valid_range(g.h_out, g.h, sh, off_h);
        let (ow_lo, ow_hi) = valid_range(wo, g.w, sw, off_w);
        if ow_lo == ow_hi {
            return;
        }
        for oh in oh_lo..oh_hi {
            let ih = ((oh * sh) as isize + off_h) as usize;
            let iw0 = ((ow_lo * sw) as isize + off_w) as usize;
            let inp = &src[oh * wo + ow_lo..oh * wo + ow_hi];
            let dst = &mut plane[ih * g.w..(ih + 1) * g.w];
            if sw == 1 {
                for (d, &s) in dst[iw0..iw0 + inp.len()].iter_mut().zip(inp) {
                    *d += s;
                }
            } else {
                for (j, &s) in inp.iter().enumerate() {
                    dst[iw0 + j * sw] += s;
                }
            }
        }
    });
}
