//! CIFAR-10 binary batch bytes as `Cifar10::load` parses them.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = hemi::data::Cifar10::parse(data);
});
