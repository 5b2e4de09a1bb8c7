//! The unit tests of `hemi::cuda::launch` (`src/cuda/launch.rs`), run against the built library.

use hemi::cuda::launch::*;

/// Simulates a grid-stride loop: how many times each element index is visited. Only for
/// small n; checks every element is covered exactly once.
fn covered_exactly_once(n: u64, d: LaunchDims) -> bool {
    let total = d.grid.0 as u64 * d.block.0 as u64;
    let mut hits = vec![0u8; n as usize];
    for t in 0..total {
        let mut i = t;
        while i < n {
            hits[i as usize] += 1;
            i += total;
        }
    }
    hits.iter().all(|&h| h == 1)
}

#[test]
fn elementwise_covers_every_element_once() {
    assert_eq!(elementwise(0), None);
    for n in [1, 255, 256, 257, 1000, 65_536, 300_001] {
        let d = elementwise(n).unwrap();
        assert_eq!(d.block, (256, 1, 1));
        assert!(d.grid.0 >= 1 && d.grid.0 <= MAX_GRID_X);
        assert!(covered_exactly_once(n, d), "n = {n}");
    }
    assert_eq!(elementwise(257).unwrap().grid.0, 2);
}

#[test]
fn huge_sizes_cap_the_grid_without_overflow() {
    for n in [1u64 << 32, (1 << 40) + 7, 1 << 62, u64::MAX] {
        let d = elementwise(n).unwrap();
        assert_eq!(d.grid.0, MAX_GRID_X, "n = {n}");
        // The kernel's `i += stride` never wraps: i < n and stride = threads <= 2^24, so
        // i + stride < 2^64 whenever n <= 2^64 - 2^24.
        assert!(d.threads() <= 1 << 24);
        assert!(n.checked_add(d.threads()).is_some() || n > u64::MAX - (1 << 24));
    }
    assert_eq!(
        ((1u64 << 40) + 7).div_ceil(elementwise(1 << 40).unwrap().threads()),
        65_537
    );
    // The largest index a thread touches is below n and representable.
    let d = elementwise(1 << 40).unwrap();
    let last_start = d.threads() - 1;
    assert!(last_start < 1 << 40);
}

#[test]
fn rows_choose_warp_or_block_per_row() {
    assert!(rows(0, 10).is_none());
    let r = rows(100, 1024).unwrap();
    assert_eq!(r.strategy, RowStrategy::WarpPerRow);
    assert_eq!(r.dims.grid.0, 13, "8 rows per 256-thread block");
    let r = rows(100, 1025).unwrap();
    assert_eq!(r.strategy, RowStrategy::BlockPerRow);
    assert_eq!(r.dims.grid.0, 100);
    let r = rows(1 << 40, 3).unwrap();
    assert_eq!(r.dims.grid.0, MAX_GRID_X);
    let r = rows(5, 0).unwrap();
    assert_eq!(r.strategy, RowStrategy::WarpPerRow);
    assert_eq!(r.dims.grid.0, 1);
    assert_eq!(r.dims.block.0 % WARP, 0, "warp kernels need whole warps");
}

#[test]
fn multi_tensor_grid_respects_the_y_limit() {
    assert_eq!(multi_tensor(0, 10).unwrap(), None);
    assert_eq!(multi_tensor(3, 0).unwrap(), None);
    let d = multi_tensor(3, 1000).unwrap().unwrap();
    assert_eq!(d.grid, (4, 3, 1));
    let d = multi_tensor(100_000, 1 << 30).unwrap().unwrap();
    assert_eq!(d.grid, (1024, MAX_GRID_Y, 1));
}
