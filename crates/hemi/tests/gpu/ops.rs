//! The op suite of `tests/ops/naive.rs` (`tests/ops/suite.rs`: every op forward and
//! backward through autograd, odd shapes, contiguous and strided views) on the wgpu backend
//! (`gpu:0`) against the CPU, in F32, F16 and BF16 (the kernels compute in F32 and store
//! no F64), with the same tolerance rule: `4 · (ε_d + n · ε_c) · max |cpu|` for a result
//! summing at most `n` terms, bit for bit where both backends do the same IEEE operations.
//!
//! Without an adapter each test prints `SKIPPED (no GPU adapter)` and returns, unless
//! `HEMI_REQUIRE_GPU=1`.

/// The backend the suite compares with the CPU.
const BACKEND: Device = Device::Gpu(0);

/// One `#[test]` per dtype the GPU computes in (F32, F16, BF16) from a body `fn(DType)`, and
/// F16 again on the packed route (`hemi::gpu::with_packed_halves`), each skipped without an
/// adapter.
macro_rules! every_dtype {
    ($(#[$m:meta])* $name:ident, $body:ident) => {
        mod $name {
            fn on(dtype: hemi::DType) {
                if crate::have_gpu(module_path!()) {
                    super::$body(dtype)
                }
            }
            $(#[$m])*
            #[test]
            fn f32() {
                on(hemi::DType::F32)
            }
            $(#[$m])*
            #[test]
            fn f16() {
                on(hemi::DType::F16)
            }
            $(#[$m])*
            #[test]
            fn bf16() {
                on(hemi::DType::BF16)
            }
            /// F16 on the packed-`u32` route, the fallback for adapters without
            /// `SHADER_F16` (`f16` runs the native route where the adapter has it).
            $(#[$m])*
            #[test]
            fn f16_packed() {
                hemi::gpu::with_packed_halves(|| on(hemi::DType::F16))
            }
        }
    };
}

include!("../ops/suite.rs");
