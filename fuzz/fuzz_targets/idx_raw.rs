//! Raw (uncompressed) IDX bytes as the MNIST reader parses them: the same input is tried
//! as an image file and as a label file, and parsed images become a data set.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hemi_fuzz::idx(data);
});
