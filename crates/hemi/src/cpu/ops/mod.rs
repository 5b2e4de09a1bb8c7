//! The CPU backend's primitives: the `impl *Ops for CpuStorage` blocks, one file per area of
//! `backend/`.

pub mod nn;
