//! The portable INT8 kernels: plain Rust over the unpacked rows (`portable-i8`, the
//! reference), and the twins of the SIMD kernels on their packed layouts (`Twin`).

use std::marker::PhantomData;

use super::epilogue::{store, Epilogue};
use super::pack::{Layout, PackedB};
use super::Micro;

pub(super) fn portable(a: &[u8], m: usize, lda: usize, b: &PackedB, mut epi: Epilogue<'_>) {
    let (n, k) = (b.n, b.k);
    for i in 0..m {
        let row = &a[i * lda..i * lda + k];
        for j in 0..n {
            let w = &b.data[j * k..(j + 1) * k];
            let acc: i32 = row.iter().zip(w).map(|(&x, &y)| x as i32 * y as i32).sum();
            store(&mut epi, i, j, n, acc, b.col_sums[j]);
        }
    }
}

/// Plain Rust on a SIMD kernel's layout: each lane sums its KG products in an i32 and adds
/// them to the accumulator (wrapping, as `vpdpbusd`, `vpaddd` and `tdpbusd` do; the sums are
/// exact anyway).
pub(super) struct Twin<L>(PhantomData<L>);

impl<L: Layout> Micro for Twin<L> {
    type L = L;

    unsafe fn tile(a: &[u32], rows: usize, b: &[i8], acc: &mut [i32], accumulate: bool) {
        let (mr, nr, kg) = (L::MR, L::NR, L::KG);
        let groups = a.len() / mr;
        let bits = 32 / kg;
        let acc = &mut acc[..rows * nr];
        if !accumulate {
            acc.fill(0);
        }
        for (g, bg) in b.chunks_exact(nr * kg).take(groups).enumerate() {
            for (r, acc) in acc.chunks_exact_mut(nr).enumerate() {
                let x = a[L::a_at(r, g, groups)];
                let mut lanes = [0i32; 4];
                for (q, v) in lanes[..kg].iter_mut().enumerate() {
                    *v = ((x >> (bits * q)) & ((1 << bits) - 1)) as i32;
                }
                let x = &lanes[..kg];
                for (s, w) in acc.iter_mut().zip(bg.chunks_exact(kg)) {
                    let lane = x.iter().zip(w).map(|(&x, &w)| x * w as i32).sum::<i32>();
                    *s = s.wrapping_add(lane);
                }
            }
        }
    }
}
