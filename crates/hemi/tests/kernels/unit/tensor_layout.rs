//! The unit tests of `hemi::tensor::layout` (`src/tensor/layout.rs`), run against the built library.

use hemi::tensor::layout::*;

#[test]
fn gather_transposed() {
    // [[0,1,2],[3,4,5]] transposed -> [[0,3],[1,4],[2,5]]
    let l = Layout::new(vec![3, 2], vec![1, 3], 0);
    assert!(!l.is_contiguous());
    let src: Vec<i32> = (0..6).collect();
    assert_eq!(l.gather(&src), vec![0, 3, 1, 4, 2, 5]);
}

#[test]
fn gather_broadcast_and_offset() {
    let l = Layout::new(vec![2, 3], vec![0, 1], 2);
    let src: Vec<i32> = (0..6).collect();
    assert_eq!(l.gather(&src), vec![2, 3, 4, 2, 3, 4]);
}

/// Element `i` of the gather, by the definition: the multi-index of `i` in row-major
/// order, dotted with the strides.
fn naive<T: Copy>(l: &Layout, src: &[T]) -> Vec<T> {
    (0..l.numel())
        .map(|mut i| {
            let mut at = l.offset();
            for d in (0..l.rank()).rev() {
                at += (i % l.shape()[d]) * l.strides()[d];
                i /= l.shape()[d];
            }
            src[at]
        })
        .collect()
}

/// Gathers large enough to split across threads (odd sizes, so that the parts end
/// mid-way through the outer dims) give the definition's elements, in a pool of 3.
#[test]
fn large_gathers_split_across_threads_equal_the_definition() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let src: Vec<u32> = (0..2_000_000).collect();
    let layouts = [
        // A permuted [7, 131, 5, 37] (the innermost dim strided).
        Layout::new(vec![37, 131, 7, 5], vec![1, 37 * 5, 131 * 37 * 5, 37], 3),
        // Rows of 173 contiguous values at a row stride of 200, 3 levels.
        Layout::new(vec![9, 101, 173], vec![101 * 200, 200, 1], 11),
        // A broadcast middle dim.
        Layout::new(vec![61, 29, 97], vec![97, 0, 1], 5),
    ];
    for l in &layouts {
        assert!(!l.is_contiguous() && l.numel() >= GATHER_PAR_LEN, "{l:?}");
        let want = naive(l, &src);
        assert_eq!(pool.install(|| l.gather(&src)), want, "{l:?}");
        assert_eq!(l.gather(&src[..]), want, "{l:?} (global pool)");
    }
}

#[test]
fn broadcast_rules() {
    assert_eq!(broadcast_shapes("t", &[3, 1], &[4]).unwrap(), vec![3, 4]);
    assert_eq!(broadcast_shapes("t", &[], &[2, 2]).unwrap(), vec![2, 2]);
    assert!(broadcast_shapes("t", &[3], &[4]).is_err());
}
