//! The unit tests of `hemi::cuda::device` (`src/cuda/device.rs`), run against the built library.

use hemi::cuda::device::*;
use hemi::error::Error;

#[test]
fn candidate_names_are_cudarcs_and_include_the_soname() {
    let names = DRIVER.candidates();
    assert!(names.iter().any(|n| n == "libcuda.so.1"), "{names:?}");
    assert!(names.iter().any(|n| n == "libcuda.so"), "{names:?}");
    // cudarc was built for CUDA 13: the versioned sonames of the toolkit libraries.
    assert!(CUBLAS.candidates().iter().any(|n| n == "libcublas.so.13"));
    assert!(NVRTC.candidates().iter().any(|n| n == "libnvrtc.so.13"));
    assert!(CUBLASLT
        .candidates()
        .iter()
        .any(|n| n == "libcublasLt.so.13"));
}

#[test]
fn a_missing_library_is_an_error_naming_it_the_names_and_the_fix() {
    let mut tried = Vec::new();
    let e = CUBLAS
        .probe_with(|n| {
            tried.push(n.to_string());
            Err(format!("{n}: cannot open shared object file"))
        })
        .unwrap_err();
    assert_eq!(
        tried,
        CUBLAS.candidates(),
        "every candidate is tried in order"
    );
    let msg = e.to_string();
    assert!(matches!(e, Error::Device { op: "cuda", .. }), "{e:?}");
    for want in [
        "cuBLAS",
        "libcublas.so.13",
        "LD_LIBRARY_PATH",
        "nvidia-cublas",
        "cannot open",
    ] {
        assert!(msg.contains(want), "missing {want:?} in: {msg}");
    }
}

#[test]
fn a_library_that_exists_but_fails_to_load_is_reported_as_such() {
    let msg = DRIVER
        .probe_with(|n| {
            if n == "libcuda.so.1" {
                Err("libcuda.so.1: undefined symbol: foo".into())
            } else {
                Err(format!(
                    "{n}: cannot open shared object file: No such file or directory"
                ))
            }
        })
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("exists but failed to load: libcuda.so.1: undefined symbol"),
        "{msg}"
    );
    let names = DRIVER.candidates();
    let mut dedup = names.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), names.len(), "no name is tried twice");
}

#[test]
fn the_first_loadable_candidate_wins() {
    let names = NVRTC.candidates();
    let target = names[3].clone();
    let got = NVRTC
        .probe_with(|n| {
            if n == target {
                Ok(())
            } else {
                Err("no".into())
            }
        })
        .unwrap();
    assert_eq!(got, target);
}

#[test]
fn ordinal_out_of_range_names_ordinal_and_count() {
    check_ordinal(0, 1).unwrap();
    check_ordinal(3, 4).unwrap();
    let msg = check_ordinal(2, 2).unwrap_err().to_string();
    assert!(
        msg.contains("cuda:2") && msg.contains("2 CUDA device(s)") && msg.contains("cuda:1"),
        "{msg}"
    );
    let msg = check_ordinal(0, 0).unwrap_err().to_string();
    assert!(
        msg.contains("cuda:0") && msg.contains("0 CUDA device(s)"),
        "{msg}"
    );
}

#[test]
fn without_a_driver_the_probe_errors_instead_of_panicking() {
    // This machine may or may not have a driver; either way nothing may panic, and a
    // missing driver must surface as the library error.
    match DRIVER.probe() {
        Ok(name) => {
            println!("SKIPPED (no CUDA device): without_a_driver ... (driver found as {name})");
            assert!(device_count().is_ok());
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("CUDA driver") && msg.contains("libcuda.so.1"),
                "{msg}"
            );
            assert!(!cuda_available());
            let e = device_count().unwrap_err().to_string();
            assert_eq!(e, msg, "device_count reports the same probe error");
            // The cached second probe gives the same message, without a doubled prefix.
            assert_eq!(DRIVER.probe().unwrap_err().to_string(), msg);
        }
    }
}
