//! The unit tests of `hemi::device` (`src/device.rs`), run against the built library.

use hemi::device::*;

#[test]
fn parses_and_prints_like_torch_device() {
    assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
    assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
    assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    // `gpu` is the wgpu backend (it meant CUDA 0 before that backend existed).
    assert_eq!("gpu".parse::<Device>().unwrap(), Device::Gpu(0));
    assert_eq!("gpu:2".parse::<Device>().unwrap(), Device::Gpu(2));
    assert_eq!(Device::Gpu(2).to_string(), "gpu:2");
    assert!(Device::Gpu(0).is_gpu() && !Device::Gpu(0).is_cuda());
    for bad in [
        "",
        "tpu",
        "cuda:",
        "cuda:-1",
        "cuda:x",
        "cuda:99999999999999999999",
        "gpu:",
        "gpu:x",
        "cpu:0",
    ] {
        let e = bad.parse::<Device>().unwrap_err().to_string();
        assert!(e.contains("cannot parse"), "{bad:?}: {e}");
    }
}

#[test]
fn mixed_devices_are_an_error_naming_both() {
    assert_eq!(
        Device::check_same("add", &[Device::Cpu, Device::Cpu]).unwrap(),
        Device::Cpu
    );
    let e = Device::check_same("add", &[Device::Cpu, Device::Cuda(1)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("add") && e.contains("cpu") && e.contains("cuda:1"),
        "{e}"
    );
}
