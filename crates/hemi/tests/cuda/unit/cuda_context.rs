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
fn arch_names_cover_turing_to_blackwell_and_not_volta() {
    assert_eq!(nvrtc_arch(9, 0), Some("compute_90"));
    assert_eq!(nvrtc_arch(8, 0), Some("compute_80"));
    assert_eq!(nvrtc_arch(7, 5), Some("compute_75"));
    assert_eq!(nvrtc_arch(12, 0), Some("compute_120"));
    // NVRTC 13 rejects compute_70: CUDA 13 dropped Volta.
    assert_eq!(nvrtc_arch(7, 0), None);
    assert_eq!(nvrtc_arch(1, 0), None);
    for (ma, mi, name) in NVRTC_ARCHS {
        assert_eq!(name, format!("compute_{ma}{mi}"));
        assert!((ma, mi) >= (7, 5), "{name}");
    }
}

/// The headers of NVIDIA's PyPI wheels are found from the `lib` dir on `LD_LIBRARY_PATH`
/// (`nvidia/cu13/lib` → `nvidia/cu13/include`) and in the virtual environment's
/// site-packages; dirs without `cuda_fp16.h` are left out.
#[test]
fn wheel_include_dirs_are_found_beside_the_lib_dir_and_in_the_venv() {
    let tmp = std::env::temp_dir().join(format!("hemi-cuda-wheel-{}", std::process::id()));
    let wheel = tmp.join("site/nvidia/cu13");
    let venv_inc = tmp.join("venv/lib/python3.11/site-packages/nvidia/cu13/include");
    let empty = tmp.join("other/lib");
    for d in [
        wheel.join("lib"),
        wheel.join("include"),
        venv_inc.clone(),
        empty.clone(),
    ] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(wheel.join("include/cuda_fp16.h"), "").unwrap();
    std::fs::write(venv_inc.join("cuda_fp16.h"), "").unwrap();
    let ld = format!(
        "/nowhere:{}:{}",
        empty.display(),
        wheel.join("lib").display()
    );
    let dirs = wheel_include_dirs(Some(ld), Some(tmp.join("venv").display().to_string()));
    let canon = |p: std::path::PathBuf| p.canonicalize().unwrap().display().to_string();
    assert_eq!(
        dirs,
        vec![canon(wheel.join("include")), canon(venv_inc.clone())],
        "{dirs:?}"
    );
    assert!(wheel_include_dirs(None, None).is_empty());
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// Every generated module (F32, F16, BF16) compiles with the real NVRTC for every
/// architecture hemi supports, with an empty log: no error and no warning. Needs NVRTC
/// (the `nvidia-cuda-nvrtc` wheel, its lib dir on `LD_LIBRARY_PATH`) and the half headers
/// (`nvidia-cuda-runtime`); no GPU. Without NVRTC it prints SKIPPED, and fails where
/// `HEMI_REQUIRE_NVRTC=1` (CI, which installs both wheels).
#[test]
fn nvrtc_compiles_every_module_for_every_architecture() {
    if let Err(e) = hemi::cuda::device::NVRTC.probe() {
        assert!(
            std::env::var("HEMI_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "HEMI_REQUIRE_NVRTC=1 and NVRTC is missing: {e}"
        );
        println!("SKIPPED (no NVRTC): nvrtc_compiles_every_module_for_every_architecture ({e})");
        return;
    }
    let failures: Vec<String> = std::thread::scope(|s| {
        let jobs: Vec<_> = hemi::cuda::kernels::DTYPES
            .into_iter()
            .map(|dtype| {
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for (_, _, arch) in NVRTC_ARCHS {
                        match compile_module(dtype, arch) {
                            Ok(log) if log.is_empty() => {}
                            Ok(log) => bad.push(format!("{dtype:?} {arch}: warnings: {log}")),
                            Err(e) => bad.push(e.to_string()),
                        }
                    }
                    bad
                })
            })
            .collect();
        jobs.into_iter().flat_map(|j| j.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
