//! Launch geometry for the generated kernels.
//!
//! Every kernel loops (grid-stride over elements, or over rows), so a grid smaller than the
//! work is correct; grids are capped to keep launches cheap and to stay within the hardware's
//! limits. Element counts are `u64` and the kernels index with 64-bit integers, so sizes up to
//! 2^40 and beyond need no special case.

use crate::error::{Error, Result};

/// Threads per block for elementwise and row kernels (a multiple of the warp size).
pub const BLOCK: u32 = 256;
/// Threads in a warp.
pub const WARP: u32 = 32;
/// Cap on blocks along x: enough to fill any current GPU many times over (132 SMs x 2048
/// threads / 256 = 1056 resident blocks on an H100/H200); the kernels' loops do the rest.
pub const MAX_GRID_X: u32 = 65_536;
/// Hardware limit on `gridDim.y` (and z).
pub const MAX_GRID_Y: u32 = 65_535;
/// Rows with at most this many columns are reduced by one warp each; longer rows by a block.
pub const WARP_ROW_MAX_COLS: u64 = 1024;

/// A launch: grid and block shapes (x, y, z), and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks per grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory per block.
    pub shared_mem_bytes: u32,
}

impl LaunchDims {
    /// Threads launched in total.
    pub fn threads(&self) -> u64 {
        let (g, b) = (self.grid, self.block);
        g.0 as u64 * g.1 as u64 * g.2 as u64 * b.0 as u64 * b.1 as u64 * b.2 as u64
    }
}

fn blocks_for(work: u64, per_block: u64, cap: u32) -> u32 {
    // work >= 1 here; the division cannot overflow and the result is clamped before the cast.
    work.div_ceil(per_block).clamp(1, cap as u64) as u32
}

/// An elementwise kernel over `n` elements (grid-stride loop). `None` when `n == 0`: there is
/// nothing to launch (a zero-sized grid is a launch error in CUDA).
pub fn elementwise(n: u64) -> Option<LaunchDims> {
    (n > 0).then(|| LaunchDims {
        grid: (blocks_for(n, BLOCK as u64, MAX_GRID_X), 1, 1),
        block: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// How a row-wise kernel (reduction, softmax) maps rows to threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowStrategy {
    /// One warp per row: short rows; `BLOCK / WARP` rows per block.
    WarpPerRow,
    /// One block per row: long rows.
    BlockPerRow,
}

impl RowStrategy {
    /// The kernel-name infix (`sum_rows_warp_f16`, `sum_rows_block_f16`).
    pub fn name(self) -> &'static str {
        match self {
            RowStrategy::WarpPerRow => "warp",
            RowStrategy::BlockPerRow => "block",
        }
    }
}

/// A row-wise launch over a `rows x cols` row-major matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLaunch {
    /// Whether a warp or a block reduces each row.
    pub strategy: RowStrategy,
    /// Grid and block shapes for the launch.
    pub dims: LaunchDims,
}

/// The launch for a row kernel; `None` when there are no rows. A row of zero columns is
/// allowed (sum 0, max -inf, softmax of nothing).
pub fn rows(rows: u64, cols: u64) -> Option<RowLaunch> {
    if rows == 0 {
        return None;
    }
    let (strategy, per_block) = if cols <= WARP_ROW_MAX_COLS {
        (RowStrategy::WarpPerRow, (BLOCK / WARP) as u64)
    } else {
        (RowStrategy::BlockPerRow, 1)
    };
    Some(RowLaunch {
        strategy,
        dims: LaunchDims {
            grid: (blocks_for(rows, per_block, MAX_GRID_X), 1, 1),
            block: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        },
    })
}

/// The fused unscale over `tensors` tensors, the largest of `max_numel` elements: x loops over
/// elements, y over tensors (both with stride loops in the kernel). `None` when there is no
/// element at all.
pub fn multi_tensor(tensors: usize, max_numel: u64) -> Result<Option<LaunchDims>> {
    if tensors == 0 || max_numel == 0 {
        return Ok(None);
    }
    if tensors > u32::MAX as usize {
        return Err(Error::arg(
            "cuda multi_tensor",
            format!(
                "{tensors} tensors in one launch; at most {} supported",
                u32::MAX
            ),
        ));
    }
    Ok(Some(LaunchDims {
        // Fewer x blocks than an elementwise launch: y multiplies the total.
        grid: (
            blocks_for(max_numel, BLOCK as u64, 1024),
            (tensors as u32).min(MAX_GRID_Y),
            1,
        ),
        block: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }))
}
