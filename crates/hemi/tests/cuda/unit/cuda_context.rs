//! The unit tests of `hemi::cuda::context` (`src/cuda/context.rs`), run against the built library.

use hemi::cuda::context::*;
use hemi::error::Error;

#[test]
fn include_dirs_hold_the_half_headers_and_their_cccl_dirs() {
    let tmp = std::env::temp_dir().join(format!("hemi-cuda-inc-{}", std::process::id()));
    let (with, without) = (tmp.join("a"), tmp.join("b"));
    std::fs::create_dir_all(with.join("cccl")).unwrap();
    std::fs::create_dir_all(&without).unwrap();
    std::fs::write(with.join("cuda_fp16.h"), "").unwrap();
    let var = format!(
        "{}:{}:{}",
        without.display(),
        with.display(),
        with.display()
    );
    let dirs = include_dirs_from(
        Some(var),
        Some(tmp.join("none").display().to_string()),
        None,
    );
    let a = with.display().to_string();
    assert_eq!(&dirs[..2], &[a.clone(), format!("{a}/cccl")], "{dirs:?}");
    assert!(!dirs
        .iter()
        .any(|d| d.starts_with(&without.display().to_string())));
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn creating_a_device_without_cuda_is_an_error_not_a_panic() {
    match CudaDevice::new(0) {
        Ok(d) => {
            println!("SKIPPED (no CUDA device): creating_a_device_without_cuda (found {d:?})");
            // With a device, an absurd ordinal is the range error.
            let e = CudaDevice::new(1 << 20).unwrap_err().to_string();
            assert!(
                e.contains("cuda:1048576") && e.contains("device(s) found"),
                "{e}"
            );
        }
        Err(e) => {
            assert!(matches!(e, Error::Device { .. }), "{e:?}");
            let msg = e.to_string();
            assert!(
                msg.contains("could not load") || msg.contains("device(s) found"),
                "the error says what is missing: {msg}"
            );
        }
    }
}

#[test]
fn arch_names_cover_current_gpus() {
    assert_eq!(nvrtc_arch(9, 0), Some("compute_90"));
    assert_eq!(nvrtc_arch(8, 0), Some("compute_80"));
    assert_eq!(nvrtc_arch(1, 0), None);
}
