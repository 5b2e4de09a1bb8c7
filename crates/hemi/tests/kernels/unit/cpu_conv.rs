//! The unit tests of `hemi::cpu::conv` (`src/cpu/conv/mod.rs`), run against the built library.

use hemi::cpu::conv::im2col::*;
use hemi::cpu::conv::reference::*;
use hemi::cpu::conv::*;

fn geom(stride: usize, padding: usize, dilation: usize, groups: usize) -> Conv2dGeom {
    let (h, w, kh, kw) = (7, 6, 3, 2);
    Conv2dGeom {
        n: 3,
        c_in: 4,
        h,
        w,
        c_out: 6,
        kh,
        kw,
        stride: (stride, stride + 1),
        padding: (padding, padding),
        dilation: (dilation, dilation),
        groups,
        h_out: conv_out_size(h, kh, stride, padding, dilation).unwrap(),
        w_out: conv_out_size(w, kw, stride + 1, padding, dilation).unwrap(),
    }
}

fn wave(n: usize, f: f64) -> Vec<f64> {
    (0..n).map(|i| (i as f64 * f).sin()).collect()
}

#[test]
fn valid_range_matches_brute_force() {
    for out in 0..6 {
        for size in 1..6 {
            for stride in 1..4 {
                for off in -5..5 {
                    let want: Vec<usize> = (0..out)
                        .filter(|&o| {
                            (0..size as isize).contains(&(o as isize * stride as isize + off))
                        })
                        .collect();
                    let (lo, hi) = valid_range(out, size, stride, off);
                    assert_eq!(
                        (lo..hi).collect::<Vec<_>>(),
                        want,
                        "{out} {size} {stride} {off}"
                    );
                }
            }
        }
    }
}

#[test]
fn forward_matches_reference() {
    for (s, p, d, grp) in [(1, 0, 1, 1), (2, 1, 1, 2), (1, 2, 2, 2), (2, 1, 2, 1)] {
        let g = geom(s, p, d, grp);
        let x = wave(g.n * g.in_image(), 0.37);
        let w = wave(g.weight_len(), 0.11);
        let b = wave(g.c_out, 0.7);
        let want = conv2d_reference(&x, &w, Some(&b), &g);
        let got = conv2d_forward(&x, &w, Some(&b), &g);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "{g:?}: {a} vs {b}");
        }
    }
}

/// col2im is im2col's adjoint: <im2col(x), c> == <x, col2im(c)>.
#[test]
fn col2im_is_adjoint_of_im2col() {
    let g = geom(2, 1, 2, 1);
    let x = wave(g.in_image(), 0.3);
    let c = wave(g.col_len(), 0.17);
    let mut col = vec![0.0; g.col_len()];
    im2col(&x, &mut col, &g);
    let mut dx = vec![0.0; g.in_image()];
    col2im(&c, &mut dx, &g);
    let lhs: f64 = col.iter().zip(&c).map(|(a, b)| a * b).sum();
    let rhs: f64 = x.iter().zip(&dx).map(|(a, b)| a * b).sum();
    assert!((lhs - rhs).abs() < 1e-10, "{lhs} vs {rhs}");
}
